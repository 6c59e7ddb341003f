"""``python -m tgruntime.gateway`` (and ``tgctl gateway``): one Tinker endpoint in front of
several groups' servers (docs/tinker.md, "One endpoint for the cluster: the gateway")."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tgruntime.gateway.groups import GroupsError, GroupSource, Source, from_flags

if TYPE_CHECKING:  # aiohttp loads with the app, not with the flags (tgctl's parser)
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
    if args.config:
        return GroupSource(path=args.config)
    if args.trainergroups:
        from tgruntime.gateway.discover import TrainerGroupSource

        return TrainerGroupSource(namespace=args.trainergroups).start()
    return GroupSource(fixed=from_flags(args.group))


def build(args: argparse.Namespace) -> Gateway:
    from tgruntime.gateway.app import Gateway

    return Gateway(
        source=source_from_args(args), timeout_s=args.timeout,
        connect_timeout_s=args.connect_timeout, max_body_bytes=int(args.max_body_mb * (1 << 20)),
    )


class Running:
    """The gateway on its own event loop in a thread (``tgctl gateway``, tests)."""

    def __init__(self, gateway: Gateway, *, host: str, port: int) -> None:
        self.gateway, self.host, self.port = gateway, host, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="tinker-gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        from aiohttp import web

        from tgruntime.gateway.app import create_app

        runner = web.AppRunner(create_app(self.gateway), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        sockets = getattr(getattr(site, "_server", None), "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def start(self, timeout_s: float = 60.0) -> Running:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the gateway did not start within {timeout_s:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"the gateway failed to start: {self._error}") from self._error
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)

    def wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(1.0)


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
    try:
        running.wait()
    except KeyboardInterrupt:
        running.stop()
    return 0


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
