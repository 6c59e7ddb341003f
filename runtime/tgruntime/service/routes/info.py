"""Routes that name no object: client config, capabilities, health, telemetry."""

from __future__ import annotations

import asyncio

from aiohttp import web

from tgruntime.service import TINKER_SDK_VERSION
from tgruntime.service.core import ServiceCore, _json_log
from tgruntime.trainer.tinker_losses import TINKER_LOSSES


class InfoRoutes(ServiceCore):
    async def client_config(self, request: web.Request) -> web.Response:
        # the SDK splits forward_backward under the server's limits (service.limits): at most
        # max_datums datums, and an estimated size well under the body limit (the SDK counts
        # 4 bytes a token; the body of a loss with advantages takes about 6x that)
        lim = self.limits
        out: dict[str, object] = {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False}
        if lim.max_datums:
            out["fwdbwd_max_chunk_len"] = min(1024, lim.max_datums)
        out["fwdbwd_max_chunk_bytes_count"] = min(5_000_000, lim.max_body_bytes // 8)
        return web.json_response(out)

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300})

    async def capabilities(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "supported_models": [
                    {
                        "model_name": self.info.base_model,
                        "max_context_length": self.info.max_sequence_length,
                        "trainable": True,
                        "sampleable": True,
                    }
                ],
                "vocab_size": self.info.vocab_size,
                "losses": sorted(TINKER_LOSSES),
                "lora": (
                    f"adapters: many runs per group (at most {self.info.max_runs})"
                    if self.lora is not None
                    else "full weights (rank recorded, not applied)"
                ),
                "tinker_sdk": TINKER_SDK_VERSION,
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        """200 while the attached group is the current one; 503 with the reason otherwise
        (the Deployment's probes then restart the server, which re-attaches)."""
        try:
            why = await asyncio.wait_for(asyncio.to_thread(self.backend.staleness), timeout=10)
        except TimeoutError:
            why = "reading the group's record from Ray timed out after 10 s"
        if why is not None:
            _json_log("unhealthy", error=why)
            return web.json_response({"status": "stale", "error": why}, status=503)
        return web.json_response({"status": "ok"})

    async def telemetry(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"status": "accepted"})
