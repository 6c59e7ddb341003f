"""``python -m tgruntime.gateway`` (and ``tgctl gateway``): one Tinker endpoint in front of
several groups' servers (docs/tinker.md, "One endpoint for the cluster: the gateway")."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tgruntime.gateway.groups import GroupsError, GroupSource, Source, from_flags, read_ca
from tgruntime.service.threaded import ThreadedApp

if TYPE_CHECKING:  # aiohttp loads with the app, not with the flags (tgctl's parser)
    from aiohttp import web

    from tgruntime.gateway.app import Gateway

log = logging.getLogger("tgruntime.gateway")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--group", action="append", default=[], metavar="[NAME=]URL",
        help="a group's Tinker server (status.apiURL, or what `tgctl serve` prints); repeat "
        "for each group",
    )
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help='JSON {"groups": [{"name", "url", "models": [...]}]}, re-read when it changes; '
        "instead of --group",
    )
    p.add_argument(
        "--trainergroups", default=None, metavar="NAMESPACE",
        help="the serving TrainerGroups of NAMESPACE ('*': of every namespace), listed through "
        "the Kubernetes API every 10 s (the operator's gateway Deployment); instead of --group",
    )
    p.add_argument(
        "--ca-file", default=None, metavar="PEM",
        help="CA certificates that verify the https:// --group servers (a group's own CA, e.g. "
        "the one that signed `tgctl serve --tls-cert`); default: the system's roots",
    )
    p.add_argument("--host", default="127.0.0.1", help="listen address (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument(
        "--timeout", type=float, default=120.0,
        help="seconds any one call to a group may take, its answer included (default 120; "
        "retrieve_future long-polls 30 s)",
    )
    p.add_argument(
        "--connect-timeout", type=float, default=10.0,
        help="seconds to connect to a group (default 10)",
    )
    p.add_argument(
        "--max-body-mb", type=float, default=64.0,
        help="JSON request bodies read at most (protobuf bodies stream through; default 64)",
    )


def source_from_args(args: argparse.Namespace) -> Source:
    given = [bool(args.group), bool(args.config), bool(getattr(args, "trainergroups", None))]
    if sum(given) != 1:
        raise GroupsError(
            "give the groups one way: --group [NAME=]URL (repeated), --config FILE or "
            "--trainergroups NAMESPACE"
        )
    ca_file = getattr(args, "ca_file", None)
    if ca_file and not args.group:
        raise GroupsError(
            "--ca-file verifies --group servers; with --config give each group's caFile, and "
            "TrainerGroups carry theirs in spec.api.tls.caBundle"
        )
    if args.config:
        return GroupSource(path=args.config)
    if args.trainergroups:
        from tgruntime.gateway.discover import TrainerGroupSource

        return TrainerGroupSource(namespace=args.trainergroups).start()
    ca = read_ca(ca_file, "--ca-file") if ca_file else ""
    return GroupSource(fixed=from_flags(args.group, ca=ca))


def build(args: argparse.Namespace) -> Gateway:
    from tgruntime.gateway.app import Gateway

    return Gateway(
        source=source_from_args(args), timeout_s=args.timeout,
        connect_timeout_s=args.connect_timeout, max_body_bytes=int(args.max_body_mb * (1 << 20)),
    )


class Running(ThreadedApp):
    """The gateway on its own event loop in a thread (``tgctl gateway``, tests)."""

    what = "the gateway"

    def __init__(self, gateway: Gateway, *, host: str, port: int) -> None:
        super().__init__(host=host, port=port, thread_name="tinker-gateway")
        self.gateway = gateway

    async def _runner(self) -> web.AppRunner:
        from aiohttp import web

        from tgruntime.gateway.app import create_app

        runner = web.AppRunner(create_app(self.gateway), access_log=None)
        await runner.setup()
        return runner


def run(args: argparse.Namespace, *, prog: str) -> int:
    """Start, print the URL (or ``--json``), serve until interrupted."""
    try:
        gateway = build(args)
    except GroupsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    running = Running(gateway, host=args.host, port=args.port).start()
    groups = gateway.groups()
    if getattr(args, "json", False):
        print(json.dumps({"baseUrl": running.url, "groups": [g.name for g in groups]}))
    else:
        print(f"base URL: {running.url}  (TINKER_BASE_URL; keys: the groups' own)")
        for g in groups:
            print(f"group {g.name}: {g.url}")
        if gateway.source.error:
            print(f"config: {gateway.source.error}")
    sys.stdout.flush()
    return running.serve_foreground()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tgruntime.gateway", description=__doc__)
    add_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON line at start")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s")
    return run(args, prog="tgruntime.gateway")


if __name__ == "__main__":
    raise SystemExit(main())
