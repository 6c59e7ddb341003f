"""The core of the Tinker service: its stores, the group plumbing the routes share, and the
seq_id order of training work (app.TinkerService mixes the routes of service.routes into it).

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
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from tgruntime.service.auth import KeyStore
from tgruntime.service.backend import Backend
from tgruntime.service.futures import FutureStore, Outcome
from tgruntime.service.limits import Limits, TokenRate
from tgruntime.service.paths import Paths
from tgruntime.service.policy import Act, Policy
from tgruntime.service.runs import LoraRuns
from tgruntime.service.sampler_weights import EphemeralWeights
from tgruntime.service.sampling import SampleQueue
from tgruntime.service.sessions import Model, Registry, SamplingSession, ServiceError, new_id
from tgruntime.service.sharing import CheckpointAccess, Located
from tgruntime.service.stability import StabilityStore, max_bytes_from_env
from tgruntime.service.stops import Tokenizer, load_tokenizer

log = logging.getLogger("tgruntime.service")

PROTO = "application/x-protobuf"
POLL_S = 30.0  # retrieve_future long-poll (the SDK waits 45 s per poll)
BASE = "_base"  # {checkpointDir}/tinker/_base: the base model, saved once
RUN_SETTINGS = "lora.json"  # beside a LoRA run's saved state: the run's LoraSettings


def _json_log(event: str, **fields: Any) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps({"event": event, **fields}, default=str))


Submit = Callable[[], Awaitable[Outcome]]


class ServiceCore:
    """Stores (registries, futures, paths) and the plumbing every route uses."""

    def __init__(
        self,
        backend: Backend,
        keys: KeyStore,
        limits: Limits | None = None,
        *,
        policy: Policy | None = None,
    ) -> None:
        self.backend = backend
        self.info = backend.info
        self.keys = keys
        self.limits = limits if limits is not None else Limits()
        self.rate = TokenRate(self.limits.sampled_tokens_per_minute)
        self.futures = FutureStore()
        self.policy = policy if policy is not None else Policy()
        self.registry = Registry(policy=self.policy)
        self.paths = Paths(backend.info.checkpoint_dir)
        self.access = CheckpointAccess(paths=self.paths, policy=self.policy)
        self.samples = SampleQueue(backend, multi_lora=backend.info.lora_rank is not None)
        self.ephemeral = EphemeralWeights()  # save_weights_and_get_sampling_client's copies
        self.stability = StabilityStore(max_bytes=max_bytes_from_env())  # stable_reinforce
        self._tasks: set[asyncio.Task[None]] = set()
        self.base_state: str | None = None
        self.base_sampler: str | None = None
        self._tok: Tokenizer | None = None
        self._tok_tried = False
        self._tok_error: str | None = None  # why the tokenizer did not load
        self._tok_lock = asyncio.Lock()  # concurrent first uses wait for the one load
        info = backend.info
        self.lora: LoraRuns | None = None
        if info.lora_rank is not None:  # a LoRA group: many runs (service.runs)
            self.lora = LoraRuns(max_runs=info.max_runs, idle_run_s=info.idle_run_seconds)

    # -- start-up ---------------------------------------------------------------------
    async def prepare(self) -> None:
        """Load the tokenizer; keep the group's base weights once on disk (a model starts
        from them)."""
        await self._tokenizer()
        await asyncio.to_thread(self.backend.dp)
        await asyncio.to_thread(self.backend.client.vocab_size)  # cached: no blocking later
        await self.drop_stale_copies()
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

    async def drop_stale_copies(self) -> list[str]:
        """Free the in-memory sampler copies (``*/ephemeral/*``) the workers hold from a server
        that ran before this one: its registry died with it, so no sampling client can name them
        again, and nothing else would free them (a server restarted by its liveness probe or an
        OOM kill would leave one full copy of the weights per model on every GPU). One server
        per group is the contract (the Deployment's ``Recreate``). Returns the names dropped."""
        info = await self.backend.call("sampler_weights_info")
        names = info.get("names", []) if isinstance(info, dict) else []
        stale = [n for n in names if "/ephemeral/" in n]
        for name in stale:
            await self.backend.call("drop_sampler_weights", name)
        if stale:
            _json_log("drop_stale_sampler_weights", count=len(stale), names=stale[:8])
        return stale

    async def drop_own_copies(self, timeout_s: float = 30.0) -> None:
        """At shutdown: free the in-memory sampler copies this server made (a graceful stop
        leaves the group as it found it). Bounded: a dead group does not hold the stop."""
        names = sorted(self.ephemeral.names())
        self.ephemeral = EphemeralWeights()

        async def drop() -> None:
            for name in names:
                await self.backend.call("drop_sampler_weights", name)

        try:
            await asyncio.wait_for(drop(), timeout_s)
        except Exception as exc:  # the group may be gone; a successor drops what is left
            log.warning("dropping this server's sampler copies at stop failed: %s", exc)

    async def _tokenizer(self) -> Tokenizer | None:
        """The base model's tokenizer (``spec.model.pretrained`` or ``--tokenizer``), loaded
        once (at start-up, by :meth:`prepare`); None when the server knows no local tokenizer
        directory or it failed to load (``_tok_error`` says why). Requests that come while it
        loads wait for that one load (issue 38: math_rl's concurrent first samples were
        refused while the first one loaded it)."""
        async with self._tok_lock:
            if self._tok is None and not self._tok_tried:
                self._tok_tried = True
                path = self.info.tokenizer_id
                if path and Path(path).is_dir():
                    try:
                        self._tok = await asyncio.to_thread(load_tokenizer, path)
                    except Exception as exc:
                        self._tok_error = f"loading the tokenizer at {path} failed: {exc}"
                        log.warning("%s", self._tok_error)
                elif path:
                    self._tok_error = f"the tokenizer {path!r} is not a directory here"
        return self._tok

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
        self._drop_weights(self.ephemeral.saved(model_id, weights) + self._ephemeral_orphans())

    def _ephemeral_orphans(self) -> list[str]:
        """The in-memory copies of models retired or forgotten meanwhile (to drop)."""
        drops: list[str] = []
        for other in self.ephemeral.models():
            m = self.registry.models.get(other)
            if m is None or m.retired is not None:
                drops += self.ephemeral.forget_model(other)
        return drops

    def expire(self) -> list[str]:
        """Forget the sessions that ended ``Registry.forget_s`` ago, with their models and
        samplers (not the runs the workers still hold), and the in-memory sampler copies of the
        models forgotten; the session ids forgotten."""
        held = set(self.lora.runs) if self.lora is not None else set()
        gone = self.registry.expire(held)
        self.stability.forget_sessions(set(gone))
        drops: list[str] = []
        for other in self.ephemeral.models():  # only models forgotten, not just retired
            if other not in self.registry.models:
                drops += self.ephemeral.forget_model(other)
        self._drop_weights(drops)
        if gone:
            _json_log("expire", sessions=len(gone), left=len(self.registry.sessions))
        return gone

    async def _expire_loop(self, tick_s: float = 30.0) -> None:
        while True:
            await asyncio.sleep(tick_s)
            try:
                self.expire()
            except Exception as exc:
                log.warning("expiring the registries failed: %s", exc)

    @staticmethod
    def _who(request: web.Request) -> str:
        """The principal of the request's key (the middleware resolved it)."""
        who = request.get("principal")
        assert isinstance(who, str), "a route that names an object needs a principal"
        return who

    def _locate(self, uri: str, who: str, act: Act = Act.READ) -> Located:
        """A checkpoint ``who`` may ``act`` on (its own, shared with it, or any as an admin);
        else the 404 of a missing one (service.sharing)."""
        return self.access.locate(str(uri), who, act)

    @staticmethod
    def _failure(exc: BaseException) -> Outcome:
        if isinstance(exc, ServiceError):
            return Outcome(error=str(exc), category=exc.category)
        from tgruntime.controller.errors import WorkerMethodError

        if isinstance(exc, WorkerMethodError | ValueError):
            return Outcome(error=str(exc), category="user")
        return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")

    def _run(self, submit: Submit, owner: str) -> str:
        rid = self.futures.new(owner)

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
        rid = self.futures.new(model.owner)

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

    # -- shared by the routes -----------------------------------------------------------
    def _admit(self, who: str, model: Model | None = None, seq_id: int | None = None) -> None:
        """The queued-requests quota (service.limits), checked before anything is created. A
        model's next seq_id always goes in: the requests queued behind it wait for it."""
        if model is not None and seq_id is not None and seq_id == model.order.next:
            return
        self.limits.check_queued(who, self.futures.queued(who))

    def _live_samplers(self, who: str) -> int:
        """The principal's sampling sessions that still sample: of a live session, and not on
        in-memory weights already freed (an RL loop's older save_weights_and_get_sampling_client
        copies do not count; the inflight clients of one model count once: they share its
        weights, and an RL loop makes one a step)."""
        resident = self.ephemeral.names()
        shared: set[str | None] = set()
        n = 0
        for ss in self.registry.samplers.values():
            if ss.owner != who:
                continue
            sess = self.registry.sessions.get(ss.session_id)
            if sess is None or not self.registry.alive(sess):
                continue
            w = ss.weights
            if ss.inflight:
                if w in shared:
                    continue
                shared.add(w)
            if w is not None and "/ephemeral/" in w and w not in resident:
                continue
            n += 1
        return n

    def _refused(self, model_id: str, exc: ServiceError, owner: str) -> web.Response:
        """A new model refused for the group's capacity (another session's full-weight model,
        spec.api.maxRuns) is answered through its future, so the SDK raises the message at once:
        sent as HTTP 409 or 429, the SDK retries it (its rule for those codes) for about a minute
        before the user sees it."""
        _json_log("refused", model_id=model_id, status=exc.status, error=str(exc))
        rid = self.futures.new(owner)
        self.futures.fail(rid, str(exc), exc.category)
        return web.json_response({"request_id": rid, "model_id": model_id})

    def _check_optimizer(self, cfg: Any) -> None:
        if cfg is not None and isinstance(cfg, dict) and cfg.get("type", "adamw") != "adamw":
            raise ServiceError(
                f"optimizer {cfg.get('type')!r} is not supported: the group trains with AdamW"
            )

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

    def _new_sampler(
        self, sid: str, weights: str | None, path: str | None, owner: str, *, inflight: bool = False
    ) -> SamplingSession:
        ss = SamplingSession(
            new_id("smp-"), sid, weights, path, self.info.base_model, owner=owner,
            inflight=inflight,
        )
        self.registry.samplers[ss.sampling_session_id] = ss
        return ss

