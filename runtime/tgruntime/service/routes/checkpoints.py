"""Routes of training runs and checkpoints (listings)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from tgruntime.service.core import BASE, ServiceCore


class CheckpointRoutes(ServiceCore):
    def _run_json(self, run_id: str) -> dict[str, Any]:
        cps = self.paths.listing(run_id)
        m = self.registry.models.get(run_id)
        last = {t: [c for c in cps if c["checkpoint_type"] == t] for t in ("training", "sampler")}
        stamp = max([c["time"] for c in cps], default=None)
        return {
            "training_run_id": run_id,
            "base_model": self.info.base_model,
            "model_owner": "trainergroup",
            "is_lora": self.lora is not None,
            "lora_rank": m.lora_rank if m is not None and self.lora is not None else None,
            "corrupted": False,
            "last_request_time": stamp
            or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.created if m else time.time())),
            "last_checkpoint": last["training"][-1] if last["training"] else None,
            "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
        }

    async def training_runs(self, request: web.Request) -> web.Response:
        ids = sorted(set(self.paths.runs()) - {BASE} | set(self.registry.models))
        runs = [self._run_json(i) for i in ids]
        return web.json_response(
            {
                "training_runs": runs,
                "cursor": {"offset": 0, "limit": len(runs), "total_count": len(runs)},
            }
        )

    async def training_run(self, request: web.Request) -> web.Response:
        return web.json_response(self._run_json(request.match_info["run_id"]))

    async def run_checkpoints(self, request: web.Request) -> web.Response:
        return web.json_response({"checkpoints": self.paths.listing(request.match_info["run_id"])})

    async def checkpoints(self, request: web.Request) -> web.Response:
        cps = [c for c in self.paths.listing() if c["training_run_id"] != BASE]
        return web.json_response(
            {
                "checkpoints": cps,
                "cursor": {"offset": 0, "limit": len(cps), "total_count": len(cps)},
            }
        )
