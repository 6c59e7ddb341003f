"""Many training runs on one LoRA group: fair turns, the run limit, idle parking.

On a group with ``spec.lora`` every ``create_model`` is a run of its own on the workers
(``MegatronTrainer.create_run``: its adapter and AdamW state on the shared frozen base).
The workers hold one active run; the server switches it (``use_run``) right before each
group call of another run, in the same synchronous submission, so no other call can come
between the switch and the call.

:class:`FairTurns` gives the group to one run's call at a time, round robin over the runs
that have a call waiting: a run that floods the server with requests gets one turn in
every cycle, like every other run, and none starves. :class:`LoraRuns` tracks which runs
the workers hold, the ``maxRuns`` limit and the idle runs to park.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

__all__ = ["FairTurns", "LoraRuns", "RunState"]


class FairTurns:
    """One holder at a time; waiters are served round robin by run, FIFO within a run."""

    def __init__(self) -> None:
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self._busy = False
        self._last: str | None = None
        self.granted: list[str] = []  # the order turns were given (kept short; for tests)

    def _next_run(self) -> str | None:
        ready = [r for r, q in self._waiting.items() if q]
        if not ready:
            return None
        if self._last in self._waiting:
            keys = list(self._waiting)
            start = keys.index(self._last) + 1
            for run in keys[start:] + keys[:start]:
                if self._waiting[run]:
                    return run
        return ready[0]

    def _grant(self) -> None:
        while not self._busy:
            run = self._next_run()
            if run is None:
                return
            fut = self._waiting[run].popleft()
            if fut.done():  # cancelled while waiting
                continue
            self._busy, self._last = True, run
            self.granted.append(run)
            del self.granted[:-1000]
            fut.set_result(None)

    def _release(self) -> None:
        self._busy = False
        self._grant()

    @contextlib.asynccontextmanager
    async def turn(self, run: str) -> AsyncIterator[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(run, collections.deque()).append(fut)
        self._grant()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # granted, then cancelled before it could be used
            raise
        try:
            yield
        finally:
            self._release()

    def waiting(self, run: str) -> int:
        """How many of the run's calls wait for a turn (tests wait on it, not on the clock)."""
        return len(self._waiting.get(run, ()))

    def forget(self, run: str) -> None:
        """Drop a run's (empty) place in the cycle."""
        q = self._waiting.get(run)
        if q is not None and not q:
            del self._waiting[run]


@dataclass
class RunState:
    """What the server knows of one run on the workers."""

    run_id: str
    rank: int
    steps: int = 0
    last_call: float = field(default_factory=time.time)
    parked: bool = False
    dropping: bool = False  # its session ended; the workers are letting go of it


class LoraRuns:
    """The runs the workers hold (besides their own ``default`` run), and the limits."""

    def __init__(self, *, max_runs: int, idle_run_s: float) -> None:
        self.max_runs = max_runs
        self.idle_run_s = idle_run_s
        self.runs: dict[str, RunState] = {}
        self.turns = FairTurns()
        self.active: str | None = None  # the run the workers were last told to use

    def full(self) -> bool:
        return len(self.runs) >= self.max_runs

    def touch(self, run_id: str) -> None:
        state = self.runs.get(run_id)
        if state is not None:
            state.last_call = time.time()
            state.parked = False

    def idle(self, now: float) -> list[str]:
        """Runs with no call for ``idle_run_s`` that are not parked yet (0: never)."""
        if self.idle_run_s <= 0:
            return []
        return [
            r.run_id
            for r in self.runs.values()
            if not r.parked and now - r.last_call >= self.idle_run_s
        ]

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "id": r.run_id,
                "rank": r.rank,
                "steps": r.steps,
                "lastCall": r.last_call,
                "parked": r.parked,
            }
            for r in self.runs.values()
        ]
