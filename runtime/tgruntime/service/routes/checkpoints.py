"""Routes of training runs and checkpoints: listings, and the lifecycle (issue 38): delete,
TTL (set at save, changed later, expired by :meth:`CheckpointRoutes.sweep`), weights_info,
copy_weights (save_weights_external: routes/external.py)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from aiohttp import web

from tgruntime.service.core import BASE, RUN_SETTINGS, ServiceCore, _json_log, log
from tgruntime.service.paths import check_ttl, parse_uri
from tgruntime.service.policy import Act
from tgruntime.service.sessions import ServiceError

SWEEP_TICK_S = 60.0  # how often expired checkpoints are looked for
SWEEP_LIMIT = 256  # checkpoints deleted per sweep at most (the rest at the next tick)
COPY_KEYS_KEPT = 1024  # X-Idempotency-Key answers of copy_weights remembered


class CheckpointRoutes(ServiceCore):
    def _runs(self, who: str) -> dict[str, str]:
        """The runs ``who`` may see, with their owners: its own, on disk in its folder or in
        the registry; an admin's hold every principal's (service.policy)."""
        out: dict[str, str] = {}
        owners = [who]
        if self.policy.is_admin(who):
            owners += [p for p in self.paths.principals() if p != who]
        for owner in owners:
            runs = [r for r in self.paths.runs(owner) if r != BASE]
            if runs and self.policy.may(who, owner, Act.READ):
                out |= {r: owner for r in runs if r not in out}
        for m in self.policy.visible(who, self.registry.models.values(), Act.READ):
            out.setdefault(m.model_id, m.owner)
        return out

    def _run_json(self, run_id: str, owner: str) -> dict[str, Any]:
        cps = self.paths.listing(owner, run_id)
        m = self.registry.owned_model(run_id, owner)
        last = {t: [c for c in cps if c["checkpoint_type"] == t] for t in ("training", "sampler")}
        stamp = max([c["time"] for c in cps], default=None)
        return {
            "training_run_id": run_id,
            "base_model": self.info.base_model,
            "model_owner": owner,
            "is_lora": self.lora is not None,
            "lora_rank": m.lora_rank if m is not None and self.lora is not None else None,
            "corrupted": False,
            "last_request_time": stamp
            or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.created if m else time.time())),
            "last_checkpoint": last["training"][-1] if last["training"] else None,
            "last_sampler_checkpoint": last["sampler"][-1] if last["sampler"] else None,
            "user_metadata": m.user_metadata
            if m is not None
            else self.paths.run_metadata(owner, run_id),
        }

    @staticmethod
    def _page(request: web.Request, total: int) -> tuple[int, int]:
        """(offset, limit) of the SDK's ``limit``/``offset`` query (default: everything)."""
        got: dict[str, int] = {}
        for name, default in (("offset", 0), ("limit", total)):
            raw = request.query.get(name)
            try:
                got[name] = default if raw is None else int(raw)
            except ValueError:
                got[name] = -1
            if got[name] < 0:
                raise ServiceError(f"{name} must be a whole number >= 0, got {raw!r}")
        return got["offset"], got["limit"]

    async def training_runs(self, request: web.Request) -> web.Response:
        runs_of = self._runs(self._who(request))
        ids = sorted(runs_of)
        offset, limit = self._page(request, len(ids))
        runs = [self._run_json(i, runs_of[i]) for i in ids[offset : offset + limit]]
        return web.json_response(
            {
                "training_runs": runs,
                "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)},
            }
        )

    def _own_run(self, request: web.Request) -> tuple[str, str]:
        """(run id, owner) of a run the caller may see; else the 404 of a missing one."""
        who, run_id = self._who(request), request.match_info["run_id"]
        owner = self._runs(who).get(run_id)
        if owner is None:
            raise ServiceError(f"unknown training run {run_id!r}", status=404)
        return run_id, owner

    async def training_run(self, request: web.Request) -> web.Response:
        run_id, who = self._own_run(request)
        return web.json_response(self._run_json(run_id, who))

    async def run_checkpoints(self, request: web.Request) -> web.Response:
        run_id, who = self._own_run(request)
        return web.json_response({"checkpoints": self.paths.listing(who, run_id)})

    async def checkpoints(self, request: web.Request) -> web.Response:
        """The caller's checkpoints of every run, newest first (as the SDK documents
        ``list_user_checkpoints``), a page of them when ``limit``/``offset`` are given; an
        admin's hold every principal's."""
        who = self._who(request)
        owners = set(self._runs(who).values()) if self.policy.is_admin(who) else {who}
        cps = [
            c
            for owner in sorted(owners)
            for c in self.paths.listing(owner)
            if c["training_run_id"] != BASE
        ]
        cps.sort(key=lambda c: str(c["time"]), reverse=True)
        offset, limit = self._page(request, len(cps))
        return web.json_response(
            {
                "checkpoints": cps[offset : offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(cps)},
            }
        )

    # -- lifecycle (issue 38) -----------------------------------------------------------
    def _checkpoint(self, request: web.Request, act: Act = Act.DELETE) -> tuple[str, Any]:
        """(tinker path, directory) of the checkpoint named by the route, when the caller may
        ``act`` on it (its own; any, for an admin); else the 404 of a missing one."""
        run_id, kind = request.match_info["run_id"], request.match_info["kind"]
        uri = f"tinker://{run_id}/{kind}/{request.match_info['name']}"
        at = self._locate(uri, self._who(request), act)
        return uri, at.dir

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        """``DELETE training_runs/{run}/checkpoints/{kind}/{name}`` (the SDK's
        ``delete_checkpoint(_from_tinker_path)``): the directory and its sidecar go."""
        uri, d = self._checkpoint(request)
        freed = await asyncio.to_thread(self.paths.delete, d)
        _json_log("delete_checkpoint", path=uri, bytes=freed)
        return web.Response(status=204)

    async def set_checkpoint_ttl(self, request: web.Request) -> web.Response:
        """``PUT .../ttl`` ``{ttl_seconds}`` (``set_checkpoint_ttl_from_tinker_path``): from
        now; null removes the expiry."""
        uri, d = self._checkpoint(request)
        ttl = check_ttl((await self._body(request)).get("ttl_seconds"))
        self.paths.set_ttl(d, ttl)
        _json_log("set_checkpoint_ttl", path=uri, ttl_seconds=ttl)
        return web.Response(status=204)

    async def publish_checkpoint(self, request: web.Request) -> web.Response:
        self._checkpoint(request)
        raise ServiceError(
            "publishing a checkpoint is not supported by this server: checkpoints are their "
            "principal's alone; share one with a principal by name instead: PUT "
            ".../checkpoints/{kind}/{name}/readers/<principal> (docs/security.md, 'Sharing a "
            "checkpoint')"
        )

    async def weights_info(self, request: web.Request) -> web.Response:
        """``POST weights_info {tinker_path}``: base model and LoRA settings of a checkpoint
        (the SDK's ``get_weights_info_by_tinker_path``)."""
        who = self._who(request)
        uri = str((await self._body(request)).get("tinker_path"))
        at = self._locate(uri, who)
        kind, d = at.kind, at.dir
        meta = self.paths.meta(d)
        lora = meta.get("lora")
        if kind == "weights" and (d / RUN_SETTINGS).is_file():
            lora = json.loads((d / RUN_SETTINGS).read_text())
        m = self.registry.owned_model(at.model_id, at.owner)
        if lora is None and m is not None and self.lora is not None:
            lora = m.lora_settings
        if not isinstance(lora, dict):
            lora = None
        return web.json_response(
            {
                "base_model": meta.get("base_model") or self.info.base_model,
                "is_lora": lora is not None,
                "lora_rank": None if lora is None else lora.get("rank"),
                "train_unembed": None if lora is None else lora.get("train_unembed", True),
                "train_mlp": None if lora is None else lora.get("train_mlp", True),
                "train_attn": None if lora is None else lora.get("train_attn", True),
            }
        )

    async def copy_weights(self, request: web.Request) -> web.Response:
        """``POST copy_weights``: a copy of one's own checkpoint as a checkpoint of a new
        training run ``copy-<32 hex>`` (which nothing trains), with its own ``ttl_seconds``.
        This server has no projects: ``destination_project_id`` is recorded in the copy's
        sidecar only. Copying another account's weights (``weights_access_token``) is
        refused."""
        who = self._who(request)
        body = await self._body(request)
        key = request.headers.get("X-Idempotency-Key")
        done: dict[tuple[str, str], str] = self.__dict__.setdefault("_copies", {})
        if key and (who, key) in done:  # the SDK's retry of a copy already made
            return web.json_response({"tinker_path": done[(who, key)]})
        if body.get("weights_access_token") or request.headers.get(
            "X-Tinker-Weights-Access-Token"
        ):
            raise ServiceError(
                "copy_weights with a weights_access_token (another account's weights) is not "
                "supported: its owner shares the checkpoint with you by name (PUT "
                ".../readers/<principal>, docs/security.md), then copy it with your own key"
            )
        src = str(body.get("source_path"))
        ttl = check_ttl(body.get("ttl_seconds"))
        _, kind, name = parse_uri(src)
        d = self._locate(src, who).dir
        run_id = f"copy-{secrets.token_hex(16)}"
        dst = await asyncio.to_thread(self.paths.copy, d, who, run_id, kind, name)
        meta = self.paths.meta(d)
        self.paths.saved(
            dst,
            ttl=ttl,
            user_metadata=meta.get("user_metadata"),
            base_model=meta.get("base_model") or self.info.base_model,
            run_metadata={
                "copied_from": src,
                "destination_project_id": str(body.get("destination_project_id") or ""),
            },
            lora=meta.get("lora"),
        )
        uri = self.paths.uri(run_id, kind, name)
        if key:
            if len(done) >= COPY_KEYS_KEPT:
                done.pop(next(iter(done)))
            done[(who, key)] = uri
        _json_log("copy_weights", source=src, path=uri)
        return web.json_response({"tinker_path": uri})

    def sweep(self, now: float | None = None) -> list[tuple[str, int]]:
        """Delete the checkpoints whose TTL has passed (at most ``SWEEP_LIMIT``)."""
        gone = self.paths.sweep(now, limit=SWEEP_LIMIT)
        for path, freed in gone:
            _json_log("checkpoint_expired", path=path, bytes=freed)
        return gone

    async def _sweep_loop(self, tick_s: float = SWEEP_TICK_S) -> None:
        """At start-up, then every ``tick_s``."""
        while True:
            try:
                await asyncio.to_thread(self.sweep)
            except Exception as exc:
                log.warning("expiring checkpoints failed: %s", exc)
            await asyncio.sleep(tick_s)
