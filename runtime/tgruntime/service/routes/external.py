"""External weights (issue 38): ``save_weights_external`` and ``get_external_weights_urls`` of
SDK 0.38, what ``tinker_cookbook.weights.download`` uses for ``tinker://.../external_weights/...``
paths.

- ``POST save_weights_external {model_id, path, seq_id, ttl_seconds}``: the run's weights as a
  Hugging Face checkpoint (``TrainerClient.export_hf``: ``config.json`` and safetensors shards)
  into ``tinker://<model>/external_weights/<path>``, in the model's ``seq_id`` turn like any
  save. Its sidecar keeps the TTL; it lists, expires, is deleted and copied like the other
  kinds; it cannot be loaded or sampled from (it is a Hugging Face folder, not a state).
  With ``age_encryption_recipients`` (``age1...`` keys) every file is stored encrypted to
  them as ``<file>.age`` (service.age; the export is written to a hidden folder first and
  removed once encrypted). Refused with 400 (the ``seq_id`` turn still taken): bad recipients,
  and a LoRA group (its runs' adapters have no Hugging Face export yet).
- ``GET training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls``:
  ``{urls: {file: signed link}, expires}`` for a checkpoint the caller may read (owner,
  reader, admin); the links (``/signed/file``, service.signed) need no key and serve one file
  each until they expire."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from tgruntime.service import age
from tgruntime.service.archive import members
from tgruntime.service.core import ServiceCore, _json_log
from tgruntime.service.futures import Outcome
from tgruntime.service.paths import check_name, check_ttl, disk_bytes
from tgruntime.service.policy import Act
from tgruntime.service.routes.archive import ArchiveRoutes, _origin
from tgruntime.service.sessions import Model, ServiceError
from tgruntime.service.signed import FILE_ROUTE

KIND = "external_weights"
URLS_ROUTE = (
    "/api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls"
)


def _encrypt_all(plain: Path, d: Path, recipients: list[Any]) -> None:
    """Every file of the export ``plain`` into ``d`` as ``<file>.age``; ``plain`` removed."""
    try:
        if d.exists():
            shutil.rmtree(d)
        for p in members(plain):
            rel = p.relative_to(plain)
            if p.is_dir():
                (d / rel).mkdir(parents=True, exist_ok=True)
                continue
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            age.encrypt_file(p, d / rel.with_name(rel.name + ".age"), recipients)
    finally:
        shutil.rmtree(plain, ignore_errors=True)


class ExternalRoutes(ArchiveRoutes, ServiceCore):
    def _skip_turn(self, model: Model, seq: object) -> None:
        """A refused request still takes its ``seq_id`` turn, so the model's next request
        is not held up behind it."""
        if isinstance(seq, int) and seq >= model.order.next:

            async def skip() -> None:
                with contextlib.suppress(ServiceError):
                    await model.order.admit(seq)
                await model.order.done(seq)

            self._spawn(skip())

    async def save_weights_external(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model = self.registry.model(str(body.get("model_id")), self._who(request))
        seq = body.get("seq_id")
        try:
            raw = body.get("age_encryption_recipients")
            recipients = None if raw is None else age.check_recipients(raw)
            if self.lora is not None:
                raise ServiceError(
                    "save_weights_external is not supported on a LoRA group yet (a run's "
                    "adapters have no Hugging Face export here): save_weights_for_sampler, "
                    "then fetch its archive (GET .../checkpoints/sampler_weights/<name>/archive)"
                )
            name = check_name(str(body.get("path") or ""))
            ttl = check_ttl(body.get("ttl_seconds"))
            d = self.paths.directory(model.owner, model.model_id, KIND, name)
        except ServiceError:
            self._skip_turn(model, seq)
            raise
        self._admit(model.owner, model, seq)
        uri = self.paths.uri(model.model_id, KIND, name)

        plain = d if recipients is None else d.with_name(f".{name}.export")

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            plain.mkdir(parents=True, exist_ok=True)
            future = self.backend.client.export_hf(str(plain))

            async def wait() -> Outcome:
                await self.backend.wait(future)
                if recipients is not None:
                    await asyncio.to_thread(_encrypt_all, plain, d, recipients)
                self.paths.saved(
                    d, ttl=ttl, user_metadata=None, base_model=self.info.base_model,
                    run_metadata=model.user_metadata,
                )
                size = await asyncio.to_thread(disk_bytes, d)
                _json_log("save_weights_external", path=uri, bytes=size)
                return Outcome(
                    body={"type": "save_weights_external", "path": uri, "size_bytes": size}
                )

            return wait

        rid = self._ordered(model, seq, prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    async def external_weights_urls(self, request: web.Request) -> web.Response:
        m = request.match_info
        uri = f"tinker://{m['run_id']}/{KIND}/{m['name']}"
        at = self._locate(uri, self._who(request), Act.READ)
        files = [p for p in await asyncio.to_thread(members, at.dir) if p.is_file()]
        urls: dict[str, str] = {}
        expires = 0
        for p in files:
            rel = p.relative_to(at.dir).as_posix()
            query, expires = self.links.sign(owner=at.owner, path=at.uri, file=rel)
            urls[rel] = f"{_origin(request)}{FILE_ROUTE}?{query}"
        if not files:
            expires = self.links.sign(owner=at.owner, path=at.uri)[1]
        _json_log("external_weights_urls", path=at.uri, owner=at.owner, files=len(urls))
        return web.json_response(
            {"urls": urls, "expires": dt.datetime.fromtimestamp(expires, dt.UTC).isoformat()}
        )

    async def signed_file(self, request: web.Request) -> web.StreamResponse:
        link = self.links.check(dict(request.query), scope="file")
        d = self.paths.parse(link.path, link.owner)[3]  # 404 when deleted since
        f = d / link.file
        if not any(p == f for p in await asyncio.to_thread(members, d)) or not f.is_file():
            raise ServiceError(f"no file {link.file!r} in {link.path}", status=404)
        _json_log("external_weights_download", path=link.path, owner=link.owner, file=link.file)
        return web.FileResponse(f, headers={"Cache-Control": "no-store"})

    def add_external_routes(self, app: web.Application) -> None:
        app.router.add_get(URLS_ROUTE, self.external_weights_urls)
        app.router.add_get(FILE_ROUTE, self.signed_file)
