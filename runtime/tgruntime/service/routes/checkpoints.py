"""Routes of training runs and checkpoints (listings)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from tgruntime.service.core import BASE, ServiceCore
from tgruntime.service.sessions import ServiceError


class CheckpointRoutes(ServiceCore):
    def _run_ids(self, who: str) -> set[str]:
        """The runs ``who`` may see: on disk in its folder, or in the registry as its own."""
        mine = self.registry.policy.visible(who, self.registry.models.values())
        return set(self.paths.runs(who)) - {BASE} | {m.model_id for m in mine}

    def _run_json(self, run_id: str, who: str) -> dict[str, Any]:
        cps = self.paths.listing(who, run_id)
        m = self.registry.owned_model(run_id, who)
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
        who = self._who(request)
        runs = [self._run_json(i, who) for i in sorted(self._run_ids(who))]
        return web.json_response(
            {
                "training_runs": runs,
                "cursor": {"offset": 0, "limit": len(runs), "total_count": len(runs)},
            }
        )

    def _own_run(self, request: web.Request) -> tuple[str, str]:
        """(run id, principal) of a run the caller may see; else the 404 of a missing one."""
        who, run_id = self._who(request), request.match_info["run_id"]
        if run_id not in self._run_ids(who):
            raise ServiceError(f"unknown training run {run_id!r}", status=404)
        return run_id, who

    async def training_run(self, request: web.Request) -> web.Response:
        run_id, who = self._own_run(request)
        return web.json_response(self._run_json(run_id, who))

    async def run_checkpoints(self, request: web.Request) -> web.Response:
        run_id, who = self._own_run(request)
        return web.json_response({"checkpoints": self.paths.listing(who, run_id)})

    async def checkpoints(self, request: web.Request) -> web.Response:
        cps = [c for c in self.paths.listing(self._who(request)) if c["training_run_id"] != BASE]
        return web.json_response(
            {
                "checkpoints": cps,
                "cursor": {"offset": 0, "limit": len(cps), "total_count": len(cps)},
            }
        )
