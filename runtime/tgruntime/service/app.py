"""The aiohttp application: the Tinker API (SDK 0.38.0) over one trainer group.

Training work of a model runs in seq_id order: a request is admitted when its seq_id is the
next one, its group call is submitted (TrainerClient calls run in submission order), and the
next seq_id may go. Anything the server cannot do faithfully is refused at once: a bad
request body answers 4xx; a well-formed request that is refused still takes its seq_id
turn (so the client's next request is not stuck behind it) and its future fails with the
reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from tgruntime.service import TINKER_SDK_VERSION
from tgruntime.service.auth import KeyStore
from tgruntime.service.backend import Backend
from tgruntime.service.codec import (
    FwdBwdIn,
    decode_forward_backward,
    encode_forward_backward,
    encode_sample,
)
from tgruntime.service.datum import metrics, outputs, to_tensors
from tgruntime.service.futures import FutureStore, Outcome
from tgruntime.service.paths import Paths
from tgruntime.service.runs import LoraRuns, RunState
from tgruntime.service.sampler_weights import EphemeralWeights, FreedWeights
from tgruntime.service.sampling import SampleJob, SampleQueue
from tgruntime.service.sessions import Model, Registry, SamplingSession, ServiceError
from tgruntime.service.stops import Tokenizer, cut_sequences, load_tokenizer, token_stops
from tgruntime.trainer.tinker_losses import TINKER_LOSSES, tinker_loss_name

log = logging.getLogger("tgruntime.service")

PROTO = "application/x-protobuf"
POLL_S = 30.0  # retrieve_future long-poll (the SDK waits 45 s per poll)
BASE = "_base"  # {checkpointDir}/tinker/_base: the base model, saved once
RUN_SETTINGS = "lora.json"  # beside a LoRA run's saved state: the run's LoraSettings


def _json_log(event: str, **fields: Any) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps({"event": event, **fields}, default=str))


Submit = Callable[[], Awaitable[Outcome]]


class TinkerService:
    def __init__(self, backend: Backend, keys: KeyStore) -> None:
        self.backend = backend
        self.info = backend.info
        self.keys = keys
        self.futures = FutureStore()
        self.registry = Registry()
        self.paths = Paths(backend.info.checkpoint_dir)
        self.samples = SampleQueue(backend, multi_lora=backend.info.lora_rank is not None)
        self.ephemeral = EphemeralWeights()  # save_weights_and_get_sampling_client's copies
        self._tasks: set[asyncio.Task[None]] = set()
        self.base_state: str | None = None
        self.base_sampler: str | None = None
        self._tok: Tokenizer | None = None
        self._tok_tried = False
        info = backend.info
        self.lora: LoraRuns | None = None
        if info.lora_rank is not None:  # a LoRA group: many runs (service.runs)
            self.lora = LoraRuns(max_runs=info.max_runs, idle_run_s=info.idle_run_seconds)

    # -- start-up ---------------------------------------------------------------------
    async def prepare(self) -> None:
        """Keep the group's base weights once on disk (a model starts from them)."""
        await asyncio.to_thread(self.backend.dp)
        await asyncio.to_thread(self.backend.client.vocab_size)  # cached: no blocking later
        if self.paths.root is None or self.lora is not None:
            return  # a LoRA group: runs start from fresh adapters; base sampling is None
        base = self.paths.root / BASE
        state, sampler = base / "state", base / "sampler"
        if not (state / "meta.json").is_file():
            state.mkdir(parents=True, exist_ok=True)
            await self.backend.call("save_state", str(state))
        if not sampler.is_dir() or not any(sampler.iterdir()):
            sampler.mkdir(parents=True, exist_ok=True)
            await self.backend.call("save_sampler_weights", str(sampler), str(sampler))
        self.base_state, self.base_sampler = str(state), str(sampler)

    # -- plumbing ---------------------------------------------------------------------
    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _drop_weights(self, names: list[str]) -> None:
        """Free in-memory sampler weights in the group (queued behind the calls before)."""
        for name in names:
            future = self.backend.client.drop_sampler_weights(name)

            async def wait(future: Any = future, name: str = name) -> None:
                try:
                    await self.backend.wait(future)
                    _json_log("drop_sampler_weights", weights=name)
                except Exception as exc:
                    log.warning("dropping sampler weights %s failed: %s", name, exc)

            self._spawn(wait())

    def _ephemeral_saved(self, model_id: str, weights: str) -> None:
        drops = self.ephemeral.saved(model_id, weights)
        for other in list(self.ephemeral.newest):  # models retired meanwhile: theirs go too
            m = self.registry.models.get(other)
            if m is None or m.retired is not None:
                drops += self.ephemeral.forget_model(other)
        self._drop_weights(drops)

    @staticmethod
    def _failure(exc: BaseException) -> Outcome:
        if isinstance(exc, ServiceError):
            return Outcome(error=str(exc), category=exc.category)
        from tgruntime.controller.errors import WorkerMethodError

        if isinstance(exc, WorkerMethodError | ValueError):
            return Outcome(error=str(exc), category="user")
        return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")

    def _run(self, submit: Submit) -> str:
        rid = self.futures.new()

        async def go() -> None:
            try:
                outcome = await submit()
            except Exception as exc:
                outcome = self._failure(exc)
            self.futures.resolve(rid, outcome)

        self._spawn(go())
        return rid

    def _ordered(
        self,
        model: Model,
        seq_id: int | None,
        prepare: Callable[[], Callable[[], Awaitable[Outcome]]],
    ) -> str:
        """``prepare`` validates and submits the group call (synchronously, in seq_id order)
        and returns what awaits its result."""
        if seq_id is not None and seq_id < model.order.next:
            raise ServiceError(
                f"seq_id {seq_id} is out of order: model {model.model_id} already ran up to "
                f"seq_id {model.order.next - 1}; the next one is {model.order.next}"
            )
        rid = self.futures.new()

        async def go() -> None:
            finish: Callable[[], Awaitable[Outcome]] | None = None
            try:
                if seq_id is not None:
                    await model.order.admit(seq_id)
                async with self._turn(model):
                    try:
                        await self._switch_to(model)
                        finish = prepare()
                    finally:
                        if seq_id is not None:
                            await model.order.done(seq_id)
                    outcome = await finish()
            except Exception as exc:
                outcome = self._failure(exc)
            self.futures.resolve(rid, outcome)

        self._spawn(go())
        return rid

    @contextlib.asynccontextmanager
    async def _turn(self, model: Model) -> AsyncIterator[None]:
        """A LoRA group's call waits for its run's fair turn (service.runs.FairTurns) and
        holds the group until it is done; a full-weight group's calls go straight on."""
        if self.lora is None:
            yield
            return
        async with self.lora.turns.turn(model.model_id):
            yield

    async def _switch_to(self, model: Model) -> None:
        """Make the workers' active run ``model``'s (awaited: a failed switch must not let
        the call train another run)."""
        lora = self.lora
        if lora is None or model.model_id not in lora.runs:
            return
        if lora.active != model.model_id:
            lora.active = None  # unknown until the switch is confirmed
            await self.backend.call("use_run", model.model_id)
            lora.active = model.model_id
        lora.touch(model.model_id)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ServiceError(f"the request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ServiceError("the request body must be a JSON object")
        return body

    def _base(self, name: str | None) -> None:
        if not self.info.accepts(name):
            raise ServiceError(
                f"base model {name!r} is not served here: this group trains "
                f"{self.info.base_model!r} (one model per TrainerGroup)"
            )

    # -- sessions ---------------------------------------------------------------------
    async def create_session(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        s = self.registry.new_session(list(body.get("tags") or []), body.get("user_metadata"))
        _json_log("session", session_id=s.session_id, sdk=body.get("sdk_version"))
        return web.json_response({"type": "create_session", "session_id": s.session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        self.registry.session(str(body.get("session_id")))
        return web.json_response({"type": "session_heartbeat"})

    async def finish(self, request: web.Request) -> web.Response:
        sid = request.match_info["session_id"]
        self.registry.finish(sid)
        if self.lora is not None:  # free the session's runs on the workers
            for m in list(self.registry.models.values()):
                if m.session_id == sid and m.model_id in self.lora.runs:
                    self._spawn(self._drop_run(m.model_id, "its session finished"))
        return web.json_response({})

    # -- models -----------------------------------------------------------------------
    def _check_optimizer(self, cfg: Any) -> None:
        if cfg is not None and isinstance(cfg, dict) and cfg.get("type", "adamw") != "adamw":
            raise ServiceError(
                f"optimizer {cfg.get('type')!r} is not supported: the group trains with AdamW"
            )

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
        sid = str(body.get("session_id"))
        self.registry.session(sid)
        self._base(body.get("base_model"))
        if self.lora is not None:
            return await self._create_run(sid, body)
        rank = self._check_lora(body.get("lora_config"))
        self._check_optimizer(body.get("optimizer_config"))
        model_id = f"{sid}:train:{int(body.get('model_seq_id', 0))}"
        model = Model(model_id, sid, self.info.base_model, rank)
        try:
            self.registry.add_model(model)
        except ServiceError as exc:
            return self._refused(model_id, exc)
        _json_log("create_model", model_id=model_id, lora_rank=rank)

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            reset = self._reset_to_base()

            async def wait() -> Outcome:
                await reset()
                return Outcome(body={"type": "create_model", "model_id": model_id})

            return wait

        rid = self._ordered(model, None, prepare)
        return web.json_response({"request_id": rid, "model_id": model_id})

    def _refused(self, model_id: str, exc: ServiceError) -> web.Response:
        """A new model refused for the group's capacity (another session's full-weight model,
        spec.api.maxRuns) is answered through its future, so the SDK raises the message at once:
        sent as HTTP 409 or 429, the SDK retries it (its rule for those codes) for about a minute
        before the user sees it."""
        _json_log("refused", model_id=model_id, status=exc.status, error=str(exc))
        rid = self.futures.new()
        self.futures.fail(rid, str(exc), exc.category)
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

    async def _free_lapsed_runs(self) -> None:
        """Drop the runs whose session finished or stopped its heartbeat (their saved
        states stay on disk)."""
        lora = self.lora
        assert lora is not None
        for run_id in list(lora.runs):
            m = self.registry.models.get(run_id)
            sess = self.registry.sessions.get(m.session_id) if m is not None else None
            if m is None or m.retired is not None or sess is None or not self.registry.alive(sess):
                await self._drop_run(run_id, "its session ended")

    async def _drop_run(self, run_id: str, why: str) -> None:
        lora = self.lora
        assert lora is not None
        state = lora.runs.get(run_id)
        if state is None or state.dropping:
            return
        state.dropping = True
        m = self.registry.models.get(run_id)
        if m is not None and m.retired is None:
            m.retired = why
        try:
            async with lora.turns.turn(run_id):
                if lora.active == run_id:
                    lora.active = None
                await self.backend.call("drop_run", run_id)
        finally:
            lora.runs.pop(run_id, None)  # after the workers let go of it
            lora.turns.forget(run_id)
        _json_log("drop_run", model_id=run_id, why=why)

    async def _create_run(
        self, sid: str, body: dict[str, Any], *, state: Path | None = None
    ) -> web.Response:
        """``create_model`` (or a load without a model) on a LoRA group: a new run."""
        lora = self.lora
        assert lora is not None
        settings = self._run_settings(body.get("lora_config"))
        self._check_optimizer(body.get("optimizer_config"))
        model_id = f"{sid}:train:{int(body.get('model_seq_id', 0))}"
        if lora.full():
            await self._free_lapsed_runs()
        if lora.full():
            held = ", ".join(sorted(lora.runs))
            return self._refused(model_id, ServiceError(
                f"this group holds {len(lora.runs)} training runs, its limit (spec.api.maxRuns "
                f"{lora.max_runs}): {held}. Finish a session (ServiceClient's close, or let its "
                "heartbeat lapse) or raise spec.api.maxRuns",
                status=429,
            ))
        if model_id in self.registry.models:
            raise ServiceError(f"model {model_id} exists already (model_seq_id is reused)")
        model = Model(model_id, sid, self.info.base_model, settings["rank"])
        model.lora_settings = settings
        self.registry.models[model_id] = model
        lora.runs[model_id] = RunState(model_id, settings["rank"])  # holds its place
        _json_log("create_model", model_id=model_id, lora=settings)
        rid = self.futures.new()

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

    async def park_idle_runs(self) -> list[str]:
        """Park the runs idle for ``spec.api.idleRunSeconds`` (their state under
        ``{checkpointDir}/tinker/<model>/parked``); returns their ids."""
        lora = self.lora
        if lora is None or self.paths.root is None:
            return []
        parked = []
        for run_id in lora.idle(time.time()):
            d = self.paths.root / run_id / "parked"
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
        m = self.registry.model(str(body.get("model_id")))
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
                    "tokenizer_id": self.info.tokenizer_id,
                },
            }
        )

    # -- training ---------------------------------------------------------------------
    async def forward_backward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding", "") == "zstd":
            import zstandard

            try:
                raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 30)
            except zstandard.ZstdError as exc:
                raise ServiceError(f"malformed zstd body: {exc}") from None
        if PROTO not in request.headers.get("Content-Type", PROTO):
            raise ServiceError(f"forward_backward takes {PROTO} (as the tinker SDK sends it)")
        fb = decode_forward_backward(raw)
        model = self.registry.model(fb.model_id)

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            return self._fwdbwd(fb)

        rid = self._ordered(model, fb.seq_id or None, prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    def _fwdbwd(self, fb: FwdBwdIn) -> Callable[[], Awaitable[Outcome]]:
        try:
            loss = tinker_loss_name(fb.loss_fn)
        except ValueError as exc:
            raise ServiceError(str(exc)) from None
        batch, lengths = to_tensors(
            fb.data,
            loss=fb.loss_fn,
            vocab_size=self.info.vocab_size,
            max_len=self.info.max_sequence_length,
            dp=self.backend.dp(),
        )
        client = self.backend.client
        if fb.forward_only:
            keys = ("input_ids", "attention_mask", "target_ids")
            future = client.compute_log_prob({k: batch[k] for k in keys})
        else:
            future = client.forward_backward(
                batch, loss=loss, loss_config=dict(fb.loss_config), reduction="sum"
            )

        async def wait() -> Outcome:
            result = await self.backend.wait(future)
            assert result.batch is not None
            lp: torch.Tensor = result.batch["log_probs"]
            meta = dict(result.meta_info)
            if fb.forward_only:
                if fb.loss_fn == "cross_entropy":
                    w = batch["loss_mask"].to(torch.float64)
                    meta = {"loss": float(-(lp.to(torch.float64) * w).sum())}
                else:
                    meta = {}
            return Outcome(proto=encode_forward_backward(outputs(lp, lengths), metrics(meta)))

        return wait

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model = self.registry.model(str(body.get("model_id")))
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
        model = self.registry.model(str(body.get("model_id")))
        seq = body.get("seq_id")
        name = str(body.get("path") or f"step-{seq or int(time.time())}")
        d = self.paths.directory(model.model_id, "weights", name)
        saved = (d / "meta.json").exists() or (d / RUN_SETTINGS).exists()
        if d.exists() and not body.get("overwrite", False) and saved:
            raise ServiceError(f"weights {name!r} already exist for {model.model_id}")
        run = self._run_of(model)

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            d.mkdir(parents=True, exist_ok=True)
            client = self.backend.client
            future = client.save_state(str(d)) if run is None else client.save_run(str(d))

            async def wait() -> Outcome:
                await self.backend.wait(future)
                if run is not None:  # what a load without a model creates the run from
                    (d / RUN_SETTINGS).write_text(json.dumps(run, indent=2))
                uri = self.paths.uri(model.model_id, "weights", name)
                return Outcome(body={"type": "save_weights", "path": uri})

            return wait

        rid = self._ordered(model, seq, prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        model = self.registry.model(str(body.get("model_id")))
        name = body.get("path")

        def prepare() -> Callable[[], Awaitable[Outcome]]:
            if name:
                d = self.paths.directory(model.model_id, "sampler_weights", str(name))
                d.mkdir(parents=True, exist_ok=True)
                weights, disk = str(d), str(d)
            else:  # save_weights_and_get_sampling_client: in memory only
                n = body.get("sampling_session_seq_id", model.sampler_count)
                model.sampler_count += 1
                weights, disk = f"{model.model_id}/ephemeral/{n}", None
            future = self.backend.client.save_sampler_weights(weights, disk)

            async def wait() -> Outcome:
                await self.backend.wait(future)
                if name:
                    uri = self.paths.uri(model.model_id, "sampler_weights", str(name))
                    return Outcome(body={"type": "save_weights_for_sampler", "path": uri})
                self._ephemeral_saved(model.model_id, weights)
                ss = self._new_sampler(model.session_id, weights, None)
                return Outcome(
                    body={
                        "type": "save_weights_for_sampler",
                        "path": None,
                        "sampling_session_id": ss.sampling_session_id,
                    }
                )

            return wait

        rid = self._ordered(model, body.get("seq_id"), prepare)
        return web.json_response({"request_id": rid, "model_id": model.model_id})

    async def load_weights(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        uri = str(body.get("path"))
        _, kind, _, d = self.paths.parse(uri)
        if kind != "weights":
            raise ServiceError(
                f"{uri} holds sampler weights (for sampling); load a tinker://.../weights/... "
                "path saved by save_state"
            )
        optimizer = bool(body.get("optimizer", False))
        self._check_state_kind(uri, d)
        if self.lora is not None and not body.get("model_id"):
            sid = str(body.get("session_id"))
            self.registry.session(sid)
            self._base(body.get("base_model"))
            saved = json.loads((d / RUN_SETTINGS).read_text())
            return await self._create_run(
                sid, {**body, "lora_config": saved, "optimizer": optimizer}, state=d
            )
        if body.get("model_id"):
            model = self.registry.model(str(body["model_id"]))
            seq = body.get("seq_id")
        else:
            sid = str(body.get("session_id"))
            self.registry.session(sid)
            self._base(body.get("base_model"))
            self._check_optimizer(body.get("optimizer_config"))
            model = Model(
                f"{sid}:train:{int(body.get('model_seq_id', 0))}", sid, self.info.base_model, None
            )
            try:
                self.registry.add_model(model)
            except ServiceError as exc:
                return self._refused(model.model_id, exc)
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

    # -- sampling ---------------------------------------------------------------------
    def _new_sampler(self, sid: str, weights: str | None, path: str | None) -> SamplingSession:
        n = len(self.registry.samplers)
        ss = SamplingSession(f"{sid}:sample:{n}", sid, weights, path, self.info.base_model)
        self.registry.samplers[ss.sampling_session_id] = ss
        return ss

    def _weights_for(self, model_path: str | None, base_model: str | None) -> str | None:
        if model_path:
            _, kind, _, d = self.paths.parse(model_path)
            if kind != "sampler_weights":
                raise ServiceError(
                    f"{model_path} is a training state; sample from a "
                    "tinker://.../sampler_weights/... path (save_weights_for_sampler)"
                )
            return str(d)
        self._base(base_model)
        return self.base_sampler

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        sid = str(body.get("session_id"))
        self.registry.session(sid)
        weights = self._weights_for(body.get("model_path"), body.get("base_model"))
        ss = self._new_sampler(sid, weights, body.get("model_path"))
        return web.json_response(
            {"type": "create_sampling_session", "sampling_session_id": ss.sampling_session_id}
        )

    async def get_sampler(self, request: web.Request) -> web.Response:
        ss = self.registry.samplers.get(request.match_info["sampler_id"])
        if ss is None:
            raise ServiceError(
                f"unknown sampler {request.match_info['sampler_id']!r} (after a server restart, "
                "create the sampling client again from its tinker:// path)",
                status=404,
            )
        return web.json_response(
            {
                "sampler_id": ss.sampling_session_id,
                "base_model": ss.base_model,
                "model_path": ss.model_path,
            }
        )

    async def _tokenizer(self) -> Tokenizer | None:
        """The base model's tokenizer (``spec.model.pretrained`` or ``--tokenizer``), loaded
        once on first use; None when the server knows no local tokenizer directory."""
        if self._tok is None and not self._tok_tried:
            self._tok_tried = True
            path = self.info.tokenizer_id
            if path and Path(path).is_dir():
                try:
                    self._tok = await asyncio.to_thread(load_tokenizer, path)
                except Exception as exc:
                    log.warning("cannot load the tokenizer at %s: %s", path, exc)
        return self._tok

    async def _stop(self, stop: Any) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """(token stop sequences for the sampler, stop strings to cut at after decoding)."""
        if stop is None:
            return tuple((e,) for e in self.info.eos_token_ids), ()
        if isinstance(stop, str) or (
            isinstance(stop, list) and any(isinstance(s, str) for s in stop)
        ):
            strings = (stop,) if isinstance(stop, str) else tuple(stop)
            if not all(isinstance(s, str) and s for s in strings):
                raise ServiceError(
                    f"stop must be a string, a list of strings or a list of token ids, got "
                    f"{stop!r}"
                )
            tok = await self._tokenizer()
            if tok is None:
                raise ServiceError(
                    "stop strings need the base model's tokenizer, and this server has none "
                    "(spec.model.pretrained or --tokenizer): pass stop token ids, e.g. the "
                    "renderer's get_stop_sequences() as ints"
                )
            eos = tuple((e,) for e in self.info.eos_token_ids)
            return eos + token_stops(tok, strings), strings
        if not isinstance(stop, list) or not all(isinstance(s, int) for s in stop):
            raise ServiceError(f"stop must be a list of token ids, got {stop!r}")
        return tuple((int(s),) for s in stop), ()

    async def asample(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body.get("sampling_session_id"):
            ss = self.registry.samplers.get(str(body["sampling_session_id"]))
            if ss is None:
                raise ServiceError(
                    f"unknown sampling session {body['sampling_session_id']!r} (after a "
                    "server restart, create the sampling client again from its tinker:// "
                    "path)",
                    status=404,
                )
            weights = ss.weights
        else:
            weights = self._weights_for(body.get("model_path"), body.get("base_model"))
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise ServiceError(f"{key} is not supported by this server")
        if body.get("target_prompt_logprobs") is not None:
            raise ServiceError("target_prompt_logprobs is not supported by this server")
        tokens: list[int] = []
        for chunk in (body.get("prompt") or {}).get("chunks") or []:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise ServiceError(f"{chunk.get('type')} chunks are not supported (text only)")
            tokens += [int(t) for t in chunk.get("tokens") or []]
        if not tokens:
            raise ServiceError("the prompt is empty")
        vocab = self.info.vocab_size
        bad = [t for t in tokens if t < 0 or t >= vocab]
        if bad:
            raise ServiceError(
                f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {vocab})"
            )
        p = dict(body.get("sampling_params") or {})
        limit = self.info.max_sequence_length
        max_tokens = p.get("max_tokens")
        max_tokens = limit - len(tokens) if max_tokens is None else int(max_tokens)
        if max_tokens < 1 or len(tokens) + max_tokens > limit:
            raise ServiceError(
                f"max_tokens {max_tokens} with a {len(tokens)}-token prompt exceeds the group's "
                f"sequence limit (model.maxSequenceLength {limit}); at most "
                f"{limit - len(tokens)}"
            )
        n = int(body.get("num_samples", 1))
        if n < 1:
            raise ServiceError(f"num_samples must be >= 1, got {n}")
        token_seqs, strings = await self._stop(p.get("stop"))
        job_key: tuple[Any, ...] = (
            weights,
            max_tokens,
            float(p.get("temperature", 1.0)),
            int(p.get("top_k", -1)),
            float(p.get("top_p", 1.0)),
            None if p.get("seed") is None else int(p["seed"]),
            token_seqs,
            n,
            bool(body.get("prompt_logprobs")),
        )
        try:
            self.ephemeral.begin(weights)  # ended in done(), whatever happens
        except FreedWeights as exc:
            raise ServiceError(str(exc), status=404) from None
        rid = self.futures.new()

        def done(result: dict[str, Any] | None, exc: BaseException | None) -> None:
            self._drop_weights(self.ephemeral.end(weights))
            if exc is not None:
                self.futures.resolve(rid, self._failure(exc))
                return
            assert result is not None
            seqs = result["sequences"]
            if strings:
                assert self._tok is not None
                try:
                    seqs = cut_sequences(self._tok, seqs, strings)
                except Exception as err:
                    self.futures.resolve(rid, self._failure(err))
                    return
            self.futures.resolve(rid, Outcome(proto=encode_sample(seqs, result["prompt_logprobs"])))

        self.samples.put(SampleJob(job_key, tokens, done))
        return web.json_response(
            {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(n)]}
        )

    # -- futures ----------------------------------------------------------------------
    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        outcome = await self.futures.wait(str(body.get("request_id")), POLL_S)
        if outcome is None:
            return web.json_response({"type": "try_again", "queue_state": "active"}, status=408)
        if outcome.error is not None:
            return web.json_response({"error": outcome.error, "category": outcome.category})
        if outcome.proto is not None:
            return web.Response(body=outcome.proto, content_type=PROTO)
        return web.json_response(outcome.body or {})

    # -- service info -----------------------------------------------------------------
    async def client_config(self, request: web.Request) -> web.Response:
        return web.json_response({"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False})

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


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    service: TinkerService = request.app["service"]
    path = request.path
    if path.startswith("/api/v1/") and path not in ("/api/v1/healthz",):
        why = service.keys.check(request.headers.get("X-API-Key"))
        if why is not None:
            return web.json_response({"error": why, "category": "user"}, status=401)
    try:
        return await handler(request)
    except ServiceError as exc:
        _json_log("refused", path=path, status=exc.status, error=str(exc))
        return web.json_response({"error": str(exc), "category": exc.category}, status=exc.status)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.exception("unhandled error on %s", path)
        return web.json_response(
            {"error": f"{type(exc).__name__}: {exc}", "category": "server"}, status=500
        )


def create_app(service: TinkerService) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=1 << 30)
    app["service"] = service
    s = service
    v1 = "/api/v1"
    post = {
        "client/config": s.client_config,
        "client/dynamic_config": s.dynamic_config,
        "create_session": s.create_session,
        "session_heartbeat": s.heartbeat,
        "sessions/{session_id}/finish": s.finish,
        "create_model": s.create_model,
        "get_info": s.get_info,
        "forward_backward": s.forward_backward,
        "optim_step": s.optim_step,
        "save_weights": s.save_weights,
        "save_weights_for_sampler": s.save_weights_for_sampler,
        "load_weights": s.load_weights,
        "create_sampling_session": s.create_sampling_session,
        "asample": s.asample,
        "retrieve_future": s.retrieve_future,
        "telemetry": s.telemetry,
    }
    get = {
        "healthz": s.healthz,
        "get_server_capabilities": s.capabilities,
        "samplers/{sampler_id}": s.get_sampler,
        "training_runs": s.training_runs,
        "training_runs/{run_id}": s.training_run,
        "training_runs/{run_id}/checkpoints": s.run_checkpoints,
        "checkpoints": s.checkpoints,
    }
    for route, handler in post.items():
        app.router.add_post(f"{v1}/{route}", handler)
    for route, handler in get.items():
        app.router.add_get(f"{v1}/{route}", handler)
    app.router.add_get("/healthz", s.healthz)

    async def on_startup(_: web.Application) -> None:
        s.samples.start()
        if s.lora is not None:
            s._spawn(s._park_loop())

    async def on_cleanup(_: web.Application) -> None:
        await s.samples.stop()
        for t in list(s._tasks):
            t.cancel()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
