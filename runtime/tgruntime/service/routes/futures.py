"""Routes of futures: retrieve_future."""

from __future__ import annotations

from aiohttp import web

from tgruntime.service.core import POLL_S, PROTO, ServiceCore


class FutureRoutes(ServiceCore):
    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        outcome = await self.futures.wait(
            str(body.get("request_id")), POLL_S, self._who(request)
        )
        if outcome is None:
            return web.json_response({"type": "try_again", "queue_state": "active"}, status=408)
        if outcome.error is not None:
            return web.json_response({"error": outcome.error, "category": outcome.category})
        if outcome.proto is not None:
            return web.Response(body=outcome.proto, content_type=PROTO)
        return web.json_response(outcome.body or {})
