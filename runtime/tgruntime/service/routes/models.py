"""Routes of models (training runs): create, get_info, forward(_backward), optim_step, save
and load weights; a LoRA group's runs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from tgruntime.service import retention
from tgruntime.service.codec import (
    FwdBwdIn,
    decode_forward_backward,
    encode_forward_backward,
)
from tgruntime.service.core import PROTO, RUN_SETTINGS, ServiceCore, _json_log, log
from tgruntime.service.datum import forward_loss, metrics, outputs, to_tensors
from tgruntime.service.futures import Outcome
from tgruntime.service.paths import check_metadata, check_ttl
from tgruntime.service.runs import RunState
from tgruntime.service.sampler_weights import inflight_name
from tgruntime.service.sessions import Model, SamplingSession, ServiceError
from tgruntime.service.soft_targets import fold, soft_widths
from tgruntime.service.stability import stability_inputs
from tgruntime.trainer.tinker_losses import tinker_loss_name


class ModelRoutes(ServiceCore):
    @staticmethod
    def _check_lora(lora: Any) -> int | None:
        """Full weights until LoRA lands: ``rank`` is accepted and recorded, nothing is frozen;
        a config that asks to leave parts untrained is refused (docs/tinker.md)."""
        if lora is None:
            return None
        if not isinstance(lora, dict):
            raise ServiceError("lora_config must be an object")
        frozen = [k for k in ("train_unembed", "train_mlp", "train_attn") if lora.get(k) is False]
        if frozen:
            raise ServiceError(
                f"lora_config {', '.join(f'{k}=False' for k in frozen)}: this group trains full "
                "weights (LoRA adapters are not implemented yet), so it cannot leave those "
                "weights untrained; drop the option"
            )
        rank = lora.get("rank")
        if not isinstance(rank, int) or rank < 1:
            raise ServiceError(f"lora_config.rank must be a positive integer, got {rank!r}")
        return rank

    def _saved(
        self, model: Model, d: Path, ttl: int | None, meta: dict[str, str] | None
    ) -> None:
        """Beside a finished save: its TTL and user_metadata, the run's user_metadata
        (service.paths; the sweeper deletes it when its time is up)."""
        self.paths.saved(
            d, ttl=ttl, user_metadata=meta, base_model=self.info.base_model,
            run_metadata=model.user_metadata, lora=self._run_of(model),
        )

    async def _retain(self, d: Path) -> None:
        """``spec.training.keepCheckpoints``: the run's older checkpoints of ``d``'s kind go
        (service.retention), before the save's future resolves."""
        keep = self.info.keep_checkpoints
        if keep > 0:
            for gone, freed in await asyncio.to_thread(retention.prune, self.paths, d, keep):
                _json_log("checkpoint_pruned", path=str(gone), bytes=freed, keep=keep)

    def _run_of(self, model: Model) -> dict[str, Any] | None:
        """A LoRA run's settings (None on a full-weight group)."""
        if self.lora is None:
            return None
        return dict(model.lora_settings or {})

    def _reset_to_base(self) -> Callable[[], Awaitable[Outcome]]:
        if self.base_state is None:

            async def nothing() -> Outcome:
                return Outcome(body={})

            return nothing
        load = self.backend.client.load_state(self.base_state, optimizer=False)
        zero = self.backend.client.zero_grad()

        async def wait() -> Outcome:
            await self.backend.wait(load)
            await self.backend.wait(zero)
            return Outcome(body={})

        return wait

    async def create_model(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        sid, who = str(body.get("session_id")), self._who(request)
        self.registry.session(sid, who)
        self._base(body.get("base_model"))
        self._admit(who)
        if self.lora is not None:
            return await self._create_run(sid, body, who)
        rank = self._check_lora(body.get("lora_config"))
        self._check_optimizer(body.get("optimizer_config"))
        model = self._new_model(sid, body, rank, who)
        model_id = model.model_id
        try:
            self.registry.add_model(model)
        except ServiceError as exc:
            return self._refused(model_id, exc, who)
        _json_log("create_model", model_id=model_id, lora_rank=rank)

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            reset = self._reset_to_base()

            async def wait() -> Outcome:
                await reset()
                return Outcome(body={"type": "create_model", "model_id": model_id})

            return wait

        rid = self._ordered(model, None, prepare)
        return web.json_response({"request_id": rid, "model_id": model_id})

    # -- runs of a LoRA group (service.runs) -------------------------------------------
    def _run_settings(self, lora: Any) -> dict[str, Any]:
        """The SDK's ``LoraConfig`` as the workers' ``LoraSettings`` fields (alpha: the
        group's ``spec.lora.alpha``)."""
        if lora is None:
            lora = {"rank": self.info.lora_rank}
        if not isinstance(lora, dict):
            raise ServiceError("lora_config must be an object")
        rank = lora.get("rank", self.info.lora_rank)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ServiceError(f"lora_config.rank must be a positive integer, got {rank!r}")
        out: dict[str, Any] = {"rank": rank, "alpha": self.info.lora_alpha}
        for key in ("train_attn", "train_mlp", "train_unembed"):
            value = lora.get(key, True)
            if not isinstance(value, bool):
                raise ServiceError(f"lora_config.{key} must be true or false, got {value!r}")
            out[key] = value
        seed = lora.get("seed")
        out["seed"] = 0 if seed is None else int(seed)
        return out

    def _new_model(self, sid: str, body: dict[str, Any], rank: int | None, who: str) -> Model:
        """A model of session ``sid`` (not yet registered). Its id is the one the SDK derives
        (``create_training_client_from_state`` computes it client-side):
        ``{session_id}:train:{model_seq_id}``, unguessable through the session id's 128
        random bits."""
        seq = int(body.get("model_seq_id", 0))
        model_id = f"{sid}:train:{seq}"
        return Model(
            model_id, sid, self.info.base_model, rank, owner=who, seq=seq,
            user_metadata=check_metadata(body.get("user_metadata")),
        )

    async def _create_run(
        self, sid: str, body: dict[str, Any], who: str, *, state: Path | None = None
    ) -> web.Response:
        """``create_model`` (or a load without a model) on a LoRA group: a new run."""
        lora = self.lora
        assert lora is not None
        settings = self._run_settings(body.get("lora_config"))
        self._check_optimizer(body.get("optimizer_config"))
        model = self._new_model(sid, body, settings["rank"], who)
        model_id = model.model_id
        try:  # the principal's quota first: nothing is created when it refuses
            if self._runs_of(who) >= self.limits.max_runs_per_principal > 0:
                await self._free_lapsed_runs()
            self.limits.check_runs(who, self._runs_of(who))
        except ServiceError as exc:
            return self._refused(model_id, exc, who)
        if lora.full():
            await self._free_lapsed_runs()
        if lora.full():
            mine = [r for r in sorted(lora.runs) if self.registry.owned_model(r, who)]
            held = f"; yours: {', '.join(mine)}" if mine else ""
            return self._refused(model_id, ServiceError(
                f"this group holds {len(lora.runs)} training runs, its limit (spec.api.maxRuns "
                f"{lora.max_runs}){held}. Finish a session (ServiceClient's close, or let its "
                "heartbeat lapse) or raise spec.api.maxRuns",
                status=429,
            ), who)
        if self.registry.by_seq(sid, model.seq) is not None:
            raise ServiceError(
                f"this session already created a model with model_seq_id {model.seq}"
            )
        model.lora_settings = settings
        self.registry.models[model_id] = model
        lora.runs[model_id] = RunState(model_id, settings["rank"])  # holds its place
        _json_log("create_model", model_id=model_id, lora=settings)
        rid = self.futures.new(who)

        async def go() -> None:
            async with lora.turns.turn(model_id):
                try:
                    lora.active = None  # after a failed create the workers keep their own
                    await self.backend.call("create_run", model_id, settings)
                    lora.active = model_id
                    step = 0
                    if state is not None:
                        step = await self.backend.call(
                            "load_run", str(state), optimizer=bool(body.get("optimizer"))
                        )
                    lora.runs[model_id].steps = int(step)
                    out: dict[str, Any] = {"type": "create_model", "model_id": model_id}
                    if state is not None:
                        out = {"type": "load_weights", "path": body.get("path")}
                        out["model_id"] = model_id
                    outcome = Outcome(body=out)
                except Exception as exc:
                    outcome = self._failure(exc)
                    lora.runs.pop(model_id, None)
                    self.registry.models.pop(model_id, None)  # nothing half-created
                    if lora.active == model_id:  # the run exists on the workers: drop it
                        with contextlib.suppress(Exception):
                            await self.backend.call("drop_run", model_id)
                        lora.active = None
            if model_id not in lora.runs:
                lora.turns.forget(model_id)
            self.futures.resolve(rid, outcome)

        self._spawn(go())
        return web.json_response({"request_id": rid, "model_id": model_id})

    def _runs_of(self, who: str) -> int:
        """The runs the workers hold for ``who`` (a LoRA group)."""
        lora = self.lora
        assert lora is not None
        return sum(1 for r in lora.runs if self.registry.owned_model(r, who) is not None)

    async def park_idle_runs(self) -> list[str]:
        """Park the runs idle for ``spec.api.idleRunSeconds`` (their state under
        ``{checkpointDir}/tinker/principals/<owner>/<model>/parked``); returns their ids."""
        lora = self.lora
        if lora is None or self.paths.root is None:
            return []
        parked = []
        for run_id in lora.idle(time.time()):
            m = self.registry.models.get(run_id)
            if m is None:
                continue
            d = self.paths.run_dir(m.owner, run_id) / "parked"
            d.mkdir(parents=True, exist_ok=True)
            async with lora.turns.turn(run_id):
                if run_id not in lora.runs:
                    continue
                if lora.active == run_id:
                    lora.active = None  # the workers switch to their own run
                await self.backend.call("park_run", run_id, str(d))
                lora.runs[run_id].parked = True
            parked.append(run_id)
            _json_log("park_run", model_id=run_id, path=str(d))
        return parked

    async def _park_loop(self) -> None:
        lora = self.lora
        assert lora is not None
        tick = max(1.0, min(30.0, lora.idle_run_s / 4))
        while True:
            await asyncio.sleep(tick)
            try:
                await self.park_idle_runs()
            except Exception as exc:
                log.warning("parking idle runs failed (they stay loaded): %s", exc)

    async def get_info(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        m = self.registry.readable_model(str(body.get("model_id")), self._who(request))
        return web.json_response(
            {
                "type": "get_info",
                "model_id": m.model_id,
                "model_name": self.info.base_model,
                "is_lora": self.lora is not None,
                "lora_rank": m.lora_rank if self.lora is not None else None,
                "model_data": {
                    "arch": "llama",
                    "model_name": self.info.base_model,
                    "tokenizer_id": self.info.tokenizer_name,
                },
            }
        )

    # -- training ---------------------------------------------------------------------
    async def forward_backward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding", "") == "zstd":
            import zstandard

            try:
                limit = self.limits.max_body_bytes
                if zstandard.frame_content_size(raw) > limit:
                    raise self.limits.body_error(zstandard.frame_content_size(raw))
                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=limit)
            except zstandard.ZstdError as exc:
                raise ServiceError(f"malformed zstd body: {exc}") from None
        if PROTO not in request.headers.get("Content-Type", PROTO):
            raise ServiceError(f"forward_backward takes {PROTO} (as the tinker SDK sends it)")
        fb = decode_forward_backward(raw)
        model = self.registry.model(fb.model_id, self._who(request))
        self._admit(model.owner, model, fb.seq_id or None)

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            return self._fwdbwd(fb, model)

        rid = self._ordered(model, fb.seq_id or None, prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    def _fwdbwd(self, fb: FwdBwdIn, model: Model) -> Callable[[], Awaitable[Outcome]]:
        self.limits.check_datums(len(fb.data))  # in its seq_id turn: the future fails
        try:
            loss = tinker_loss_name(fb.loss_fn)
        except ValueError as exc:
            raise ServiceError(str(exc)) from None
        widths = soft_widths(fb.data, loss=fb.loss_fn)  # [N, K] soft targets: K ids a position
        batch, lengths = to_tensors(
            fb.data,
            loss=fb.loss_fn,
            vocab_size=self.info.vocab_size,
            max_len=self.info.max_sequence_length,
            dp=self.backend.dp(),
            widths=widths,
        )
        if fb.loss_fn == "stable_reinforce":  # the sampler's records (service.stability)
            rows, width = (int(x) for x in batch["input_ids"].shape)
            batch.update(stability_inputs(
                self.stability, fb.data, owner=model.owner, session_id=model.session_id,
                rows=rows, width=width,
            ))
        client = self.backend.client
        if fb.forward_only:
            keys = ("input_ids", "attention_mask", "target_ids", "target_weights")
            future = client.compute_log_prob({k: batch[k] for k in keys if k in batch})
        else:
            future = client.forward_backward(
                batch, loss=loss, loss_config=dict(fb.loss_config), reduction="sum"
            )

        async def wait() -> Outcome:
            result = await self.backend.wait(future)
            assert result.batch is not None
            lp: torch.Tensor = result.batch["log_probs"]
            meta = dict(result.meta_info)
            if fb.forward_only:  # no loss ran on the group: the same loss, on its log-probs
                meta = {"loss": forward_loss(loss, lp, batch, dict(fb.loss_config))}
            per_datum = fold(outputs(lp, lengths), widths)
            return Outcome(proto=encode_forward_backward(per_datum, metrics(meta)))

        return wait

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model = self.registry.model(str(body.get("model_id")), self._who(request))
        self._admit(model.owner, model, body.get("seq_id"))
        if "adam_params" not in body:
            kind = (body.get("optimizer_params") or {}).get("type")
            raise ServiceError(f"optimizer params {kind!r} are not supported (AdamParams only)")
        p = dict(body["adam_params"] or {})

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            lr = float(p.get("learning_rate", 1e-4))
            future = self.backend.client.optim_step(
                lr=lr,
                betas=(float(p.get("beta1", 0.9)), float(p.get("beta2", 0.95))),
                eps=float(p.get("eps", 1e-12)),
                weight_decay=float(p.get("weight_decay", 0.0)),
                grad_clip=float(p.get("grad_clip_norm", 0.0)),
            )

            async def wait() -> Outcome:
                r = await self.backend.wait(future)
                out = {"grad_norm:last": float(r.get("grad_norm", 0.0)), "lr:last": lr}
                out["step:last"] = float(r.get("step", 0))
                if self.lora is not None and model.model_id in self.lora.runs:
                    self.lora.runs[model.model_id].steps = int(r.get("step", 0))
                return Outcome(body={"type": "optim_step", "metrics": out})

            return wait

        rid = self._ordered(model, body.get("seq_id"), prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    # -- weights ----------------------------------------------------------------------
    async def save_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model = self.registry.model(str(body.get("model_id")), self._who(request))
        seq = body.get("seq_id")
        self._admit(model.owner, model, seq)
        name = str(body.get("path") or f"step-{seq or int(time.time())}")
        d = self.paths.directory(model.owner, model.model_id, "weights", name)
        saved = (d / "meta.json").exists() or (d / RUN_SETTINGS).exists()
        if d.exists() and not body.get("overwrite", False) and saved:
            raise ServiceError(f"weights {name!r} already exist for {model.model_id}")
        run = self._run_of(model)
        ttl, meta = check_ttl(body.get("ttl_seconds")), check_metadata(body.get("user_metadata"))

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            d.mkdir(parents=True, exist_ok=True)
            client = self.backend.client
            future = client.save_state(str(d)) if run is None else client.save_run(str(d))

            async def wait() -> Outcome:
                await self.backend.wait(future)
                if run is not None:  # what a load without a model creates the run from
                    (d / RUN_SETTINGS).write_text(json.dumps(run, indent=2))
                self._saved(model, d, ttl, meta)
                await self._retain(d)
                uri = self.paths.uri(model.model_id, "weights", name)
                return Outcome(body={"type": "save_weights", "path": uri})

            return wait

        rid = self._ordered(model, seq, prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model = self.registry.model(str(body.get("model_id")), self._who(request))
        self._admit(model.owner, model, body.get("seq_id"))
        name = body.get("path")
        ttl, meta = check_ttl(body.get("ttl_seconds")), check_metadata(body.get("user_metadata"))
        inflight = _inflight_kind(body.get("kind"), name)

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            if inflight:
                return self._publish_inflight(model)
            if name:
                d = self.paths.directory(
                    model.owner, model.model_id, "sampler_weights", str(name)
                )
                d.mkdir(parents=True, exist_ok=True)
                weights, disk = str(d), str(d)
            else:  # save_weights_and_get_sampling_client: in memory only
                n = body.get("sampling_session_seq_id", model.sampler_count)
                model.sampler_count += 1
                weights, disk = f"{model.model_id}/ephemeral/{n}", None
            future = self.backend.client.save_sampler_weights(weights, disk)

            async def wait() -> Outcome:
                try:
                    await self.backend.wait(future)
                except Exception:
                    if disk is not None:  # refused (the sampler-weights budget): no empty dir
                        with contextlib.suppress(OSError):
                            Path(disk).rmdir()
                    raise
                if name:
                    self._saved(model, Path(disk or ""), ttl, meta)
                    await self._retain(Path(disk or ""))
                    uri = self.paths.uri(model.model_id, "sampler_weights", str(name))
                    return Outcome(body={"type": "save_weights_for_sampler", "path": uri})
                self._ephemeral_saved(model.model_id, weights)
                ss = self._new_sampler(model.session_id, weights, None, model.owner)
                return _sampling_session(ss)

            return wait

        rid = self._ordered(model, body.get("seq_id"), prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    def _publish_inflight(self, model: Model) -> Callable[[], Awaitable[Outcome]]:
        """``save_weights_and_get_sampling_client(kind="inflight")``: a new sampling session on
        the model's current weights, no copy per call (service/sampler_weights.py). A
        full-weight group samples the training weights themselves: the group call is only the
        barrier behind the model's earlier calls, so that the save completes once they did. A
        LoRA group writes the run's adapters into the model's one inflight target."""
        if self.lora is None:
            weights: str | None = None
            future = self.backend.client.sampler_weights_info()  # ordered behind the step
        else:
            weights = inflight_name(model.model_id)
            future = self.backend.client.save_sampler_weights(weights, None)

        async def wait() -> Outcome:
            await self.backend.wait(future)
            if weights is not None:
                self.ephemeral.inflight_saved(model.model_id, weights)
            ss = self._inflight_session(model, weights)
            _json_log("publish_inflight", model_id=model.model_id, weights=weights)
            return _sampling_session(ss)

        return wait

    def _inflight_session(self, model: Model, weights: str | None) -> SamplingSession:
        """The model's one inflight sampling session (made at its first inflight save): every
        inflight client of a model samples the same current weights, so each save answers
        with the same session instead of adding one to the registry per RL step."""
        known = self.registry.samplers.get(
            self.ephemeral.inflight_sessions.get(model.model_id, "")
        )
        if known is not None and known.session_id == model.session_id and known.weights == weights:
            return known
        ss = self._new_sampler(model.session_id, weights, None, model.owner, inflight=True)
        self.ephemeral.inflight_sessions[model.model_id] = ss.sampling_session_id
        return ss

    async def load_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        uri, who = str(body.get("path")), self._who(request)
        if body.get("model_id"):
            m = self.registry.model(str(body["model_id"]), who)
            self._admit(who, m, body.get("seq_id"))
        else:
            self._admit(who)
        at = self._locate(uri, who)
        d = at.dir
        if at.kind != "weights":
            what = "sampler weights (for sampling)" if at.kind == "sampler_weights" else (
                "Hugging Face files (save_weights_external, for download)"
            )
            raise ServiceError(
                f"{uri} holds {what}; load a tinker://.../weights/... path saved by save_state"
            )
        optimizer = bool(body.get("optimizer", False))
        self._check_state_kind(uri, d)
        if self.lora is not None and not body.get("model_id"):
            sid = str(body.get("session_id"))
            self.registry.session(sid, who)
            self._base(body.get("base_model"))
            saved = json.loads((d / RUN_SETTINGS).read_text())
            return await self._create_run(
                sid, {**body, "lora_config": saved, "optimizer": optimizer}, who, state=d
            )
        if body.get("model_id"):
            model = self.registry.model(str(body["model_id"]), who)
            seq = body.get("seq_id")
        else:
            sid = str(body.get("session_id"))
            self.registry.session(sid, who)
            self._base(body.get("base_model"))
            self._check_optimizer(body.get("optimizer_config"))
            model = self._new_model(sid, body, None, who)
            try:
                self.registry.add_model(model)
            except ServiceError as exc:
                return self._refused(model.model_id, exc, who)
            seq = None

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            client = self.backend.client
            if self.lora is not None:  # the run's adapters (its pending gradient is dropped)
                load = client.load_run(str(d), optimizer=optimizer)
                zero = None
            else:
                load = client.load_state(str(d), optimizer=optimizer)
                zero = client.zero_grad()

            async def wait() -> Outcome:
                step = await self.backend.wait(load)
                if zero is not None:
                    await self.backend.wait(zero)
                if self.lora is not None and model.model_id in self.lora.runs:
                    self.lora.runs[model.model_id].steps = int(step)
                return Outcome(
                    body={"type": "load_weights", "path": uri, "model_id": model.model_id}
                )

            return wait

        rid = self._ordered(model, seq, prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    def _check_state_kind(self, uri: str, d: Path) -> None:
        """A LoRA run's state (adapters only) loads into a LoRA group, a full-weight state into
        a full-weight group."""
        is_run = (d / RUN_SETTINGS).is_file()
        if self.lora is None and is_run:
            raise ServiceError(
                f"{uri} is a LoRA run's state (adapters only, no base weights): load it into "
                "a group with spec.lora"
            )
        if self.lora is not None and not is_run:
            raise ServiceError(
                f"{uri} is a full-weight state; this group trains LoRA runs (spec.lora): load it "
                "into a full-weight group, or start a run from the base with create_model"
            )


def _inflight_kind(kind: Any, name: Any) -> bool:
    """Whether a ``save_weights_for_sampler`` request publishes inflight weights (the SDK's
    ``kind``: ``"snapshot"``, the default, or ``"inflight"``)."""
    if kind is None or kind == "snapshot":
        return False
    if kind != "inflight":
        raise ServiceError(
            f"kind must be 'snapshot' (fixed weights) or 'inflight' (the model's current "
            f"weights, shared by its inflight sampling clients), not {kind!r}"
        )
    if name:
        raise ServiceError(
            "kind='inflight' takes no path: inflight weights live in memory only; save named "
            "weights with save_weights_for_sampler(name) (kind 'snapshot')"
        )
    return True


def _sampling_session(ss: SamplingSession) -> Outcome:
    """The answer of a save without a name: the new sampling session's id."""
    return Outcome(
        body={
            "type": "save_weights_for_sampler",
            "path": None,
            "sampling_session_id": ss.sampling_session_id,
        }
    )
