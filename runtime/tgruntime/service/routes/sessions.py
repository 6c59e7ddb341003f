"""Routes of sessions: create, heartbeat, finish."""

from __future__ import annotations

from aiohttp import web

from tgruntime.service.core import ServiceCore, _json_log


class SessionRoutes(ServiceCore):
    async def create_session(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        sid = body.get("session_id")  # the gateway's own id, so a session spans its groups
        s = self.registry.new_session(
            list(body.get("tags") or []), body.get("user_metadata"), self._who(request),
            session_id=None if sid is None else str(sid),
        )
        _json_log("session", session_id=s.session_id, sdk=body.get("sdk_version"))
        return web.json_response({"type": "create_session", "session_id": s.session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.registry.session(str(body.get("session_id")), self._who(request))
        return web.json_response({"type": "session_heartbeat"})

    async def finish(self, request: web.Request) -> web.Response:
        sid = request.match_info["session_id"]
        self.registry.finish(sid, self._who(request))
        if self.lora is not None:  # free the session's runs on the workers
            for m in list(self.registry.models.values()):
                if m.session_id == sid and m.model_id in self.lora.runs:
                    self._spawn(self._drop_run(m.model_id, "its session finished"))
        return web.json_response({})
