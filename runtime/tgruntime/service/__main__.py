"""``python -m tgruntime.service``: serve the Tinker API for one trainer group (docs/tinker.md)."""

from __future__ import annotations

import argparse
import json
import logging
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tgapi
from tgapi.hub import local_dir
from tgruntime.driver.trainer_client import TrainerClient
from tgruntime.service import policy as policy_flags
from tgruntime.service import tls as tls_flags
from tgruntime.service.auth import KeyStore, env_keys
from tgruntime.service.backend import Backend, GroupInfo
from tgruntime.service.limits import Limits, add_flags, from_args
from tgruntime.service.policy import Policy
from tgruntime.service.stops import eos_from_dir
from tgruntime.service.threaded import ThreadedApp
from tgruntime.service.tls import TlsFiles

if TYPE_CHECKING:
    from aiohttp import web


log = logging.getLogger("tgruntime.service")


def group_info(
    tg_name: str,
    spec: tgapi.TrainerGroupSpec,
    *,
    base_model: str | None = None,
    tokenizer: str | None = None,
    checkpoint_dir: str | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> GroupInfo:
    """The served base model id: ``--base-model``, else ``spec.model.name`` (a Hugging Face
    id), else ``spec.model.pretrained`` (its directory, also the tokenizer), else the
    TrainerGroup's name; the others that are set stay aliases. The EOS ids for ``stop=None``:
    ``eos_token_ids`` when given, else read from the tokenizer directory
    (:func:`tgruntime.service.stops.eos_token_ids`)."""
    pretrained = spec.model.pretrained
    name = base_model or spec.model.name or pretrained or tg_name
    # a hub id's config and tokenizer are downloaded (tgapi.hub; the parse did it already)
    tok_dir = tokenizer or (local_dir(pretrained) if pretrained else None)
    if not eos_token_ids and tok_dir and Path(tok_dir).is_dir():
        eos_token_ids = eos_from_dir(tok_dir)
    return GroupInfo(
        base_model=name,
        vocab_size=spec.model.vocab_size,
        max_sequence_length=spec.model.max_sequence_length,
        checkpoint_dir=spec.training.checkpoint_dir if checkpoint_dir is None else checkpoint_dir,
        tokenizer_id=tok_dir,
        eos_token_ids=eos_token_ids,
        aliases=tuple(
            dict.fromkeys(a for a in (spec.model.name, tg_name, pretrained) if a and a != name)
        ),
        lora_rank=spec.lora.rank if spec.lora is not None else None,
        lora_alpha=spec.lora.alpha if spec.lora is not None else None,
        max_runs=spec.api.max_runs,
        idle_run_seconds=spec.api.idle_run_seconds,
        keep_checkpoints=spec.training.keep_checkpoints,
    )


def build_service(
    client: TrainerClient,
    info: GroupInfo,
    keys: KeyStore,
    limits: Limits | None = None,
    policy: Policy | None = None,
) -> Any:
    from tgruntime.service.app import TinkerService

    return TinkerService(Backend(client, info), keys, limits, policy=policy)


class Running(ThreadedApp):
    """A server on its own event loop in a thread (``tgctl serve`` in the foreground, tests);
    HTTPS when given ``tls`` (service.tls)."""

    what = "the Tinker server"

    def __init__(
        self,
        service: Any,
        host: str,
        port: int,
        tls: TlsFiles | None = None,
        *,
        tls_reload_s: float = tls_flags.RELOAD_S,
    ) -> None:
        super().__init__(host=host, port=port, thread_name="tinker-server")
        self.service = service
        self.tls, self._tls_reload_s = tls, tls_reload_s

    def _ssl_on(self) -> bool:
        return self.tls is not None

    def _ssl(self) -> ssl.SSLContext | None:
        return tls_flags.server_context(self.tls) if self.tls is not None else None

    async def _runner(self) -> web.AppRunner:
        from aiohttp import web

        from tgruntime.service.app import create_app

        await self.service.prepare()
        runner = web.AppRunner(create_app(self.service), access_log=None)
        await runner.setup()
        return runner

    async def _started(self, ctx: ssl.SSLContext | None) -> None:
        if ctx is not None and self.tls is not None:
            self.service._spawn(tls_flags.reload_loop(ctx, self.tls, self._tls_reload_s))


def serve(
    client: TrainerClient,
    info: GroupInfo,
    keys: KeyStore,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[Running], None] | None = None,
    limits: Limits | None = None,
    policy: Policy | None = None,
    tls: TlsFiles | None = None,
) -> Running:
    service = build_service(client, info, keys, limits, policy)
    running = Running(service, host, port, tls).start()
    if on_ready is not None:
        on_ready(running)
    return running


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tgruntime.service", description=__doc__)
    p.add_argument("--trainergroup", help="the Kubernetes TrainerGroup to serve")
    p.add_argument("--k8s-namespace", default=None)
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--spec", default=None, help="TrainerGroup YAML (local form)")
    p.add_argument("--group-name", default=None)
    p.add_argument("--ray-namespace", default=None)
    p.add_argument("--address", default=None, help="Ray GCS address")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--keys-file", default=None)
    p.add_argument("--keys-dir", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--base-model", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--eos-token-id", type=int, action="append", default=[])
    p.add_argument("--log-level", default="WARNING")
    add_flags(p)
    policy_flags.add_flags(p)
    tls_flags.add_flags(p)
    return p


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if msg.startswith("{"):
            return msg
        return json.dumps({"level": record.levelname, "logger": record.name, "message": msg})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter())
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    keys = KeyStore(keys=env_keys(), keys_file=args.keys_file, keys_dir=args.keys_dir)
    try:
        policy, tls = policy_flags.from_args(args), tls_flags.from_args(args)
    except ValueError as exc:
        print(f"tgruntime.service: {exc}", file=sys.stderr)
        return 2
    if keys.empty():
        print(
            "tgruntime.service: no API key configured (--keys-file, --keys-dir or "
            "TG_TINKER_API_KEY); refusing to serve without one",
            file=sys.stderr,
        )
        return 2
    if args.trainergroup:
        from tgapi.kube_view import attach_target
        from tgapi.kube_view.kube import wait_for_ready

        ready = wait_for_ready(
            name=args.trainergroup, k8s_namespace=args.k8s_namespace, kubeconfig=args.kubeconfig
        )
        spec = ready.spec
        where = attach_target(ready.status, name=args.trainergroup, address=args.address)
        client = TrainerClient.connect_local(
            group_name=where.group_name,
            ray_namespace=where.ray_namespace,
            address=where.ray_address,
        )
        name = args.trainergroup
    elif args.spec:
        tg = tgapi.load_file(args.spec, local=True)
        spec, name = tg.spec, tg.name
        client = TrainerClient.connect_local(
            group_name=args.group_name or tg.group_name,
            ray_namespace=args.ray_namespace or tg.ray_namespace,
            address=args.address,
        )
    else:
        print("tgruntime.service: pass --trainergroup NAME or --spec FILE", file=sys.stderr)
        return 2
    info = group_info(
        name,
        spec,
        base_model=args.base_model,
        tokenizer=args.tokenizer,
        checkpoint_dir=args.checkpoint_dir,
        eos_token_ids=tuple(args.eos_token_id),
    )
    running = serve(
        client, info, keys, host=args.host, port=args.port, limits=from_args(args),
        policy=policy, tls=tls,
    )
    print(
        json.dumps({"event": "serving", "url": running.url, "base_model": info.base_model}),
        flush=True,
    )
    return running.serve_foreground()


if __name__ == "__main__":
    raise SystemExit(main())
