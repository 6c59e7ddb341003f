"""Routes of read grants (service.sharing): the owner of a checkpoint (or an admin) shares it
with one principal, revokes it, or lists its readers. Not in the tinker SDK (0.38 has no
call for it): raw HTTP with the owner's key, e.g. ``curl -X PUT -H "X-API-Key: $KEY"
$URL/api/v1/training_runs/RUN/checkpoints/sampler_weights/NAME/readers/team-b``
(docs/security.md, "Sharing a checkpoint").
"""

from __future__ import annotations

from aiohttp import web

from tgruntime.service.core import ServiceCore, _json_log

READERS = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/readers"


class SharingRoutes(ServiceCore):
    def _uri(self, request: web.Request) -> str:
        m = request.match_info
        return f"tinker://{m['run_id']}/{m['kind']}/{m['name']}"

    @staticmethod
    def _answer(uri: str, readers: list[str]) -> web.Response:
        return web.json_response({"tinker_path": uri, "readers": readers})

    async def checkpoint_readers(self, request: web.Request) -> web.Response:
        """``GET .../readers``: the principals the checkpoint is shared with."""
        at, readers = self.access.readers(self._uri(request), self._who(request))
        return self._answer(at.uri, readers)

    async def share_checkpoint(self, request: web.Request) -> web.Response:
        """``PUT .../readers/{principal}``: that principal may read the checkpoint."""
        reader = request.match_info["principal"]
        at, readers = self.access.grant(self._uri(request), self._who(request), reader)
        _json_log("share_checkpoint", path=at.uri, owner=at.owner, reader=reader)
        return self._answer(at.uri, readers)

    async def unshare_checkpoint(self, request: web.Request) -> web.Response:
        """``DELETE .../readers/{principal}``: it may not any more."""
        reader = request.match_info["principal"]
        at, readers = self.access.revoke(self._uri(request), self._who(request), reader)
        _json_log("unshare_checkpoint", path=at.uri, owner=at.owner, reader=reader)
        return self._answer(at.uri, readers)

    def add_sharing_routes(self, app: web.Application) -> None:
        app.router.add_get(READERS, self.checkpoint_readers)
        app.router.add_put(f"{READERS}/{{principal}}", self.share_checkpoint)
        app.router.add_delete(f"{READERS}/{{principal}}", self.unshare_checkpoint)
