"""The continuous-batching scheduler: drives the workers' ``SlotEngine`` in short chunks.

Each group call is ``sample_step(admit, max_steps, weights)`` (``ONE_TO_ALL``: every rank gets
the same arguments, so every rank takes the same admission decisions). One call admits the
requests that arrived since the last one, runs up to ``max_steps`` decode steps over every
active row, and returns the requests that finished; rows still decoding stay in the workers
for the next call. So a request that arrives while a batch decodes waits at most one chunk,
then joins that batch (``steps_busy`` steps after a call during which requests arrived,
``steps`` otherwise, doubling with every further quiet call up to ``steps_max``: a burst is
absorbed quickly, a steady batch pays the per-call overhead rarely; a request arriving during
a long chunk waits for it, at most ``steps_max`` decode steps).

One weights at a time: the engine decodes rows of one weights; requests are admitted in
arrival order while their weights match, and the first request for other weights stops
admission (nothing overtakes it) until the running rows drain, then the engine switches.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tgruntime.service.sessions import ServiceError

log = logging.getLogger("tgruntime.service.continuous")

Done = Callable[[dict[str, Any] | None, BaseException | None], None]
StepCall = Callable[[list[dict[str, Any]], int, str | None, bool], Awaitable[dict[str, Any]]]
"""``step(admit, max_steps, weights, reset)``: one ``sample_step`` call on the group."""


def _finish(job: ContinuousJob, result: dict[str, Any] | None, exc: BaseException | None) -> None:
    try:
        job.done(result, exc)
    except Exception:  # a callback's bug must not stop the scheduler
        log.exception("a sample request's completion failed")


# How long the first of a burst of requests may wait for the rest (settle): the SDK sends a
# cookbook step's concurrent sample calls some milliseconds apart, and a request that comes
# after the group call started waits for the next one (a whole generation on the one-shot path).
GATHER_MAX_S = 0.03


async def settle(queue: asyncio.Queue[Any], *, step_s: float, max_s: float) -> None:
    """Let requests sent together arrive together: wait ``step_s``, and again while more keep
    arriving, ``max_s`` in all at most (a lone request waits ``step_s``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + max_s
    seen = -1
    while queue.qsize() != seen and loop.time() < end:
        seen = queue.qsize()
        await asyncio.sleep(min(step_s, max(0.0, end - loop.time())))


@dataclass
class ContinuousJob:
    weights: str | None
    request: dict[str, Any]  # sample_step's fields but ``id`` (prompt, max_tokens, ...)
    done: Done
    origin: Any = None  # the caller's own record of the request (for ``overflow``)

    def fits(self, slots: int, length: int) -> bool:
        r = self.request
        rows = int(r.get("num_samples", 1))
        return rows <= slots and len(r["prompt"]) + int(r["max_tokens"]) <= length


class ContinuousScheduler:
    def __init__(
        self,
        step: StepCall,
        *,
        steps: int = 16,
        steps_busy: int = 4,
        steps_max: int = 64,
        gather_s: float = 0.002,
        overflow: Callable[[ContinuousJob], None] | None = None,
    ) -> None:
        if steps < 1 or steps_busy < 1 or steps_max < steps:
            raise ValueError("steps and steps_busy must be >= 1, and steps_max >= steps")
        self.step = step
        self.steps = steps
        self.steps_busy = steps_busy
        self.steps_max = steps_max
        self._quiet = 0  # calls in a row with nothing admitted and nothing arrived
        self.gather_s = gather_s
        self._queue: asyncio.Queue[ContinuousJob] = asyncio.Queue()
        self._pending: collections.deque[ContinuousJob] = collections.deque()
        self._inflight: dict[str, ContinuousJob] = {}
        self._weights: str | None = None
        self._ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._reset = False
        self.calls = 0  # sample_step calls
        self.call_s = 0.0  # seconds spent awaiting them (the rest of a sample is the service's)
        self.worker_s = 0.0  # of them, inside the workers' sample_step (the rest: Ray's)
        self.prompts = 0  # requests admitted
        self.last: dict[str, Any] = {}  # the last call's pool info
        self.overflow = overflow  # takes the requests the pool can never hold (or all, when
        # the group has no continuous engine); None: they fail with the workers' reason
        self.pool: tuple[int, int] | None = None  # (slots, length), read at the first call
        self.disabled = False
        self.overflowed = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self, *, reset_s: float = 30.0) -> None:
        """Cancel the loop and fail what it held. When rows of this server's were decoding, one
        last call drops them from the workers (Ray runs it after the call the cancel cut off):
        a server stopped mid-sample must not leave the group's engine busy with its weights,
        refusing the next server's (bounded by ``reset_s``: a dead group does not hold the
        stop)."""
        had_rows = bool(self._inflight)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if had_rows:
            try:
                await asyncio.wait_for(self.step([], 0, None, True), timeout=reset_s)
            except Exception as exc:  # best effort at stop; said in the log
                log.warning("could not drop this server's sampling rows at stop: %s", exc)
        for job in [*self._inflight.values(), *self._pending]:
            _finish(
                job, None, ServiceError("the server is stopping", status=503, category="server")
            )
        self._inflight.clear()
        self._pending.clear()

    def put(self, job: ContinuousJob) -> None:
        self._queue.put_nowait(job)

    def _take(self, job: ContinuousJob) -> bool:
        """Queue ``job`` for the engine (True), or hand it to ``overflow`` (False)."""
        if self.overflow is not None and (
            self.disabled or (self.pool is not None and not job.fits(*self.pool))
        ):
            self.overflowed += 1
            self.overflow(job)
            return False
        self._pending.append(job)
        return True

    def _drain(self) -> bool:
        arrived = False
        while not self._queue.empty():
            arrived = self._take(self._queue.get_nowait()) or arrived
        return arrived

    async def _learn_pool(self) -> None:
        """Read the pool's size once (an empty call), so requests it can never hold go to
        ``overflow``; a group without the engine (LoRA) sends everything there."""
        if self.pool is not None or self.disabled or self.overflow is None:
            return
        try:
            out = await self.step([], 0, None, False)
        except Exception as exc:
            log.warning("no continuous batching on this group (%s): one-shot sampling", exc)
            self.disabled = True
            return
        self.pool = (int(out["slots"]), int(out["length"]))

    def _choose(self) -> list[tuple[str, ContinuousJob]]:
        if not self._inflight and self._pending:
            self._weights = self._pending[0].weights
        chosen: list[tuple[str, ContinuousJob]] = []
        while self._pending and self._pending[0].weights == self._weights:
            job = self._pending.popleft()
            request = dict(job.request)
            if request.get("seed") is None:  # one seed for every rank
                request["seed"] = secrets.randbits(62)
            chosen.append((f"r{next(self._ids)}", ContinuousJob(job.weights, request, job.done)))
        return chosen

    def _chunk(self, *, busy: bool) -> int:
        """Decode steps for the next call: ``steps_busy`` when requests just came, else
        ``steps`` doubled for every quiet call before this one, at most ``steps_max``."""
        if busy:
            self._quiet = 0
            return self.steps_busy
        k = min(self.steps << min(self._quiet, 16), self.steps_max)
        self._quiet += 1
        return k

    async def _run(self) -> None:
        arrived = False
        while True:
            if not self._inflight and not self._pending:
                first = await self._queue.get()
                await self._learn_pool()
                await settle(self._queue, step_s=self.gather_s, max_s=GATHER_MAX_S)
                arrived = self._take(first) or arrived
            arrived = self._drain() or arrived
            if not self._inflight and not self._pending:
                continue
            chosen = self._choose()
            for rid, job in chosen:
                self._inflight[rid] = job
            admit = [{"id": rid, **job.request} for rid, job in chosen]
            k = self._chunk(busy=bool(arrived or chosen))
            self.calls += 1
            self.prompts += len(chosen)
            arrived = False
            began = time.perf_counter()
            try:
                out = await self.step(admit, k, self._weights, self._reset)
                self._reset = False
            except Exception as exc:  # the workers dropped their rows: fail what was there
                log.warning("sample_step failed: %s", exc)
                self._reset = True  # the next call drops whatever the workers hold
                jobs = list(self._inflight.values())
                self._inflight.clear()
                for job in jobs:
                    _finish(job, None, exc)
                continue
            finally:
                self.call_s += time.perf_counter() - began
            self._served(out)

    def _served(self, out: dict[str, Any]) -> None:
        """A call's results: finished and failed requests; requests the workers no longer
        hold (none active or waiting) fail."""
        self.last = {k: v for k, v in out.items() if k not in ("finished", "failed")}
        self.worker_s += float(out.get("worker_s") or 0.0)
        for rid, message in (out.get("failed") or {}).items():
            failed = self._inflight.pop(rid, None)
            if failed is not None:
                _finish(failed, None, ServiceError(message))
        for rid, result in (out.get("finished") or {}).items():
            served = self._inflight.pop(rid, None)
            if served is not None:
                _finish(served, result, None)
        if out.get("active_rows") or out.get("waiting_requests"):
            return
        lost = list(self._inflight.values())  # the workers hold none of them any more
        self._inflight.clear()
        for job in lost:
            _finish(
                job,
                None,
                ServiceError("the sampler lost this request; retry", status=503, category="server"),
            )
