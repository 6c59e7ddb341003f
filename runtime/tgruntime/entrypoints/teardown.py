"""Teardown entrypoint: remove a group's actors, placement groups and record (idempotent).

    python -m tgruntime.entrypoints.teardown --group NAME --ray-namespace NS

Prints ``TG_TEARDOWN {json}`` (``tgapi.markers.Teardown``, camelCase keys). Exit status: 0
when the report says ``"complete": true`` (everything found is gone; also when nothing
was left to remove); 3 when it says ``"complete": false`` (an actor or placement group was
still there at the deadline: the group may still hold its resources, so a caller must
retry, not re-create); 1 when Ray could not be reached. The report's ``checked`` /
``notChecked`` say what was looked at.

It needs neither the worker class (actor handles come without importing it, see
``gcs_view.use_light_handles``) nor the Ray dashboard (the GCS actor table is read).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from tgapi import markers
from tgruntime.controller.errors import TrainerGroupError

if TYPE_CHECKING:
    from tgruntime.controller.teardown import TeardownReport

EXIT_INCOMPLETE = 3


def run(
    *, group: str, ray_namespace: str, address: str | None, timeout_s: float
) -> markers.Teardown:
    """Connect, tear the group down, return the ``TG_TEARDOWN`` report (raises
    TrainerGroupError)."""
    from tgruntime.controller import gcs_view
    from tgruntime.controller.connect import connect
    from tgruntime.controller.teardown import teardown_group

    connect(address=address, ray_namespace=ray_namespace, logging_level=logging.WARNING)
    gcs_view.use_light_handles()
    report = teardown_group(group_name=group, ray_namespace=ray_namespace, timeout_s=timeout_s)
    return to_marker(report)


def to_marker(report: TeardownReport) -> markers.Teardown:
    """The controller's report as the ``TG_TEARDOWN`` payload."""
    return markers.Teardown(
        group_name=report.group_name,
        ray_namespace=report.ray_namespace,
        actors_killed=report.actors_killed,
        placement_groups_removed=report.placement_groups_removed,
        keys_removed=report.keys_removed,
        complete=report.complete,
        errors=report.errors,
        checked=report.checked,
        not_checked=report.not_checked,
    )


def incomplete_message(body: markers.Teardown) -> str:
    errors = "; ".join(body.errors) or "no details"
    return (
        f"group {body.group_name!r} in Ray namespace {body.ray_namespace!r} is not fully "
        f"removed ({errors}). Run the teardown again (a longer --timeout), and do not "
        "re-create the group until it reports complete: true"
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    p = argparse.ArgumentParser(prog="tg-teardown", description=__doc__.splitlines()[0])
    p.add_argument("--group", required=True, help="group name (the TrainerGroup's name)")
    p.add_argument("--ray-namespace", required=True, help="the group's Ray namespace")
    p.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or auto)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for actors to die")
    args = p.parse_args(argv)
    try:
        body = run(
            group=args.group,
            ray_namespace=args.ray_namespace,
            address=args.address,
            timeout_s=args.timeout,
        )
    except TrainerGroupError as exc:
        print(f"tg-teardown: {exc}", file=sys.stderr)
        return 1
    print(markers.line(body), flush=True)
    if not body.complete:
        print(f"tg-teardown: {incomplete_message(body)}", file=sys.stderr)
        return EXIT_INCOMPLETE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
