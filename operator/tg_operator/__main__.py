"""``tg-operator`` / ``python -m tg_operator``: run the operator.

kopf runs standalone (no peering), with a liveness endpoint on
``TG_LIVENESS_PORT``, watching the namespaces in ``TG_NAMESPACES`` or all of them.
"""

from __future__ import annotations

import argparse
import logging
import sys

import kopf

from tg_operator import handlers
from tg_operator.settings import OperatorConfig, SettingsError

QUIET_HANDLERS = tuple(
    f"Handler '{h}' succeeded"
    for h in ("raypod-changed", "raycluster-changed", handlers.CLUSTER_INDEX, handlers.POD_INDEX)
)


class _QuietWatchHandlers(logging.Filter):
    """Drop kopf's "Handler '...' succeeded." line for the watches (one per pod event)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(QUIET_HANDLERS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tg-operator", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    parser.add_argument("--quiet", action="store_true", help="warnings and errors only")
    args = parser.parse_args(argv)
    try:
        config = OperatorConfig.from_env()
    except SettingsError as exc:
        print(f"tg-operator: {exc}", file=sys.stderr)
        return 2
    # FULL: each line has its time, logger and level, so an alert on ERROR finds real problems.
    kopf.configure(verbose=args.verbose, quiet=args.quiet, log_format=kopf.LogFormat.FULL)
    if not args.verbose:
        logging.getLogger("kopf.objects").addFilter(_QuietWatchHandlers())
    registry = kopf.OperatorRegistry()
    handlers.register(registry, config)
    liveness = (
        f"http://0.0.0.0:{config.liveness_port}/healthz" if config.liveness_port > 0 else None
    )
    kopf.run(
        registry=registry,
        standalone=True,
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=liveness,
        memo=kopf.Memo(),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
