"""Teardown entrypoint: remove a group's actors, placement groups and record (idempotent).

    python -m tgruntime.teardown --group NAME --ray-namespace NS

Prints ``TG_TEARDOWN {json}``. Exit status: 0 when the report says ``complete: true``
(everything found is gone; also when nothing was left to remove); 3 when it says
``complete: false`` (an actor or placement group was still there at the deadline: the
group may still hold its resources, so a caller must retry, not re-create); 1 when Ray
could not be reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from tgruntime import groups
from tgruntime.controller import teardown_group
from tgruntime.controller.errors import TrainerGroupError
from tgruntime.ray_connect import connect

EXIT_INCOMPLETE = 3


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    p = argparse.ArgumentParser(prog="tgruntime.teardown", description=__doc__.splitlines()[0])
    p.add_argument("--group", required=True, help="group name (the TrainerGroup's name)")
    p.add_argument("--ray-namespace", required=True, help="the group's Ray namespace")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for actors to die")
    args = p.parse_args(argv)
    try:
        connect(address=args.address, namespace=args.ray_namespace)
        report = teardown_group(
            group_name=args.group, namespace=args.ray_namespace, timeout_s=args.timeout
        )
    except TrainerGroupError as exc:
        print(f"tgruntime.teardown: {exc}", file=sys.stderr)
        return 1
    body = (
        dataclasses.asdict(report) if dataclasses.is_dataclass(report) else {"report": str(report)}
    )
    print(groups.tagged(groups.TEARDOWN_TAG, body), flush=True)
    if not getattr(report, "complete", False):
        errors = "; ".join(getattr(report, "errors", ())) or "no details"
        print(
            f"tgruntime.teardown: group {args.group!r} in Ray namespace {args.ray_namespace!r} "
            f"is not fully removed ({errors}). Run the teardown again (a longer --timeout), "
            "and do not re-create the group until it reports complete: true",
            file=sys.stderr,
        )
        return EXIT_INCOMPLETE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
