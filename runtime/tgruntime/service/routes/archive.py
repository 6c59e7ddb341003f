"""Archive links of checkpoints (issue 38): what ``tinker_cookbook.weights.download`` fetches
for a ``tinker://.../sampler_weights/...`` path.

- ``GET /api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive`` (with a key): the
  SDK's ``get_checkpoint_archive_url(_from_tinker_path)`` (tinker 0.34; SDK 0.38 dropped the
  call, the route stays for the SDKs and cookbooks that make it). Answered 200 with
  ``{url, expires}``, the JSON contract that SDK reads, for a checkpoint the caller may read
  (its own, shared with it, any for an admin); anything else is the 404 of a missing one.
- ``GET /signed/archive?owner=&path=&expires=&signature=`` (no key: the link is the
  credential, service.signed): the checkpoint as a tar stream, members relative to the
  checkpoint's folder (service.archive). An altered, expired or foreign link answers 403; a
  checkpoint deleted since the link was issued 404."""

from __future__ import annotations

import datetime as dt
from typing import Any

from aiohttp import web

from tgruntime.service.archive import tar_chunks
from tgruntime.service.core import ServiceCore, _json_log, log
from tgruntime.service.policy import Act
from tgruntime.service.signed import ARCHIVE_ROUTE, LinkSigner

ISSUE_ROUTE = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/archive"


def _origin(request: web.Request) -> str:
    """Where the client reached this server: ``X-Forwarded-Proto``/``-Host`` when a proxy
    set them (the gateway, an ingress), else the request's own scheme and Host."""
    proto = request.headers.get("X-Forwarded-Proto", request.scheme).split(",")[0].strip()
    host = request.headers.get("X-Forwarded-Host", request.host).split(",")[0].strip()
    return f"{proto}://{host}"


class ArchiveRoutes(ServiceCore):
    @property
    def links(self) -> LinkSigner:
        """The server's link signer (its secret: service.signed), made at first use."""
        got: Any = self.__dict__.get("_links")
        if got is None:
            got = self.__dict__["_links"] = LinkSigner()
        return got  # type: ignore[no-any-return]

    async def checkpoint_archive(self, request: web.Request) -> web.Response:
        m = request.match_info
        uri = f"tinker://{m['run_id']}/{m['kind']}/{m['name']}"
        at = self._locate(uri, self._who(request), Act.READ)
        query, expires = self.links.sign(owner=at.owner, path=at.uri)
        _json_log("archive_link", path=at.uri, owner=at.owner, expires=expires)
        return web.json_response(
            {
                "url": f"{_origin(request)}{ARCHIVE_ROUTE}?{query}",
                "expires": dt.datetime.fromtimestamp(expires, dt.UTC).isoformat(),
            }
        )

    async def signed_archive(self, request: web.Request) -> web.StreamResponse:
        link = self.links.check(dict(request.query))
        d = self.paths.parse(link.path, link.owner)[3]  # 404 when deleted since
        name = f"{link.path.removeprefix('tinker://').replace('/', '_').replace(':', '-')}.tar"
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/x-tar",
                "Content-Disposition": f'attachment; filename="{name}"',
                "Cache-Control": "no-store",
            }
        )
        await response.prepare(request)
        sent = 0
        try:
            async for chunk in tar_chunks(d):
                await response.write(chunk)
                sent += len(chunk)
        except Exception as exc:  # the answer has begun: cut the connection, no final chunk,
            # so the client sees an incomplete body (never a tar that reads as whole)
            log.warning("archive of %s cut short after %d bytes: %s", link.path, sent, exc)
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write_eof()
        _json_log("archive_download", path=link.path, owner=link.owner, bytes=sent)
        return response

    def add_archive_routes(self, app: web.Application) -> None:
        app.router.add_get(ISSUE_ROUTE, self.checkpoint_archive)
        app.router.add_get(ARCHIVE_ROUTE, self.signed_archive)
