"""Continuous batching's pure pieces (no Ray, no model): the per-row token choice equals the
one-shot choice row by row, the KV pool's sizing and refusals, and the scheduler's admission
order (fake ``sample_step``: pure decision logic).

* ``next_token_rows`` over a batch whose rows each carry other settings (temperature 0 / 0.7 /
  1 / 1.3, top-k, top-p, both, seeds, steps) gives, for every row, the bits that
  ``select.next_token`` gives for that row alone with its own ``SamplingParams``;
* ``PoolSize.resolve``: defaults, the budget cutting slots, a budget holding no row refused
  with the numbers, bad sizes refused naming the field;
* ``ContinuousScheduler``: one weights at a time, arrival order kept (nothing overtakes a
  request for other weights), refusals and a failed call reach the right requests.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest
import torch

from tgruntime.service.continuous import ContinuousJob, ContinuousScheduler
from tgruntime.service.sessions import ServiceError
from tgruntime.trainer.sampling.continuous import bucket
from tgruntime.trainer.sampling.params import SamplingParams, row_keys
from tgruntime.trainer.sampling.pool import PoolConfig, PoolSize
from tgruntime.trainer.sampling.rows import RowSettings, next_token_rows
from tgruntime.trainer.sampling.select import next_token

VOCAB = 50
SETTINGS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.6},
    {"temperature": 1.0, "top_k": 8, "top_p": 0.9},
    {"temperature": 0.5, "top_p": 0.3},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 2.0, "top_k": VOCAB + 7},  # k beyond the vocabulary: off
]


@pytest.mark.parametrize("step", [0, 3, 17])
def test_rows_choose_what_each_row_alone_chooses(step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for trial in range(20):
        logits = torch.randn(len(SETTINGS), VOCAB, generator=gen) * 2.0
        params = [SamplingParams.build(max_tokens=4, vocab_size=VOCAB, **s) for s in SETTINGS]
        keys = [row_keys([[trial, i]], seed=trial, num_samples=1)[0] for i in range(len(params))]
        steps = [step + i for i in range(len(params))]  # each row at its own step
        rows = RowSettings(
            temperature=torch.tensor([p.temperature for p in params]),
            top_k=torch.tensor([VOCAB if p.top_k == -1 else min(p.top_k, VOCAB) for p in params]),
            top_p=torch.tensor([p.top_p for p in params]),
            keys=torch.tensor(keys),
            step=torch.tensor(steps),
        )
        token, logprob = next_token_rows(logits, rows)
        for r, p in enumerate(params):
            want_t, want_lp = next_token(
                logits[r : r + 1], torch.tensor(keys[r : r + 1]), steps[r], p
            )
            assert int(token[r]) == int(want_t[0]), (trial, r, p)
            assert torch.equal(logprob[r], want_lp[0]), (trial, r)


def test_filters_off_when_no_row_uses_them() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = RowSettings(
        temperature=torch.tensor([1.0, 0.8, 0.0]),
        top_k=torch.full((3,), VOCAB),
        top_p=torch.ones(3),
        keys=torch.tensor([1, 2, 3]),
        step=torch.tensor([0, 1, 2]),
    )
    a = next_token_rows(logits, rows)
    b = next_token_rows(logits, rows, top_k=False, top_p=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_graph_buckets() -> None:
    assert [bucket(n, 64) for n in (1, 3, 5, 9, 13, 33, 64)] == [1, 4, 8, 12, 16, 48, 64]
    assert bucket(40, 40) == 40 and bucket(600, 1024) == 640 and bucket(513, 1024) == 640


def _size(**config: int | None) -> PoolSize:
    return PoolSize.resolve(
        PoolConfig(**config), max_sequence_length=64, bytes_per_position=100, free_bytes=None
    )


def test_pool_size_defaults_budget_and_refusals() -> None:
    size = _size()
    assert (size.slots, size.length, size.row_bytes, size.budget) == (64, 64, 6400, None)
    assert _size(slots=10, length=16).nbytes == 10 * 16 * 100
    assert _size(slots=10, length=16, kv_bytes=3 * 1600 + 5).slots == 3  # the budget cuts
    gpu = PoolSize.resolve(
        PoolConfig(), max_sequence_length=64, bytes_per_position=100, free_bytes=4 * 6400 * 4
    )
    assert gpu.budget == 4 * 6400 and gpu.slots == 4  # a quarter of the free memory
    with pytest.raises(ValueError, match=r"KV budget of 1,000 bytes holds no row.*6,400 bytes"):
        _size(kv_bytes=1000)
    with pytest.raises(ValueError, match="slots must be an integer >= 1"):
        _size(slots=0)
    with pytest.raises(ValueError, match=r"length .* must be in \[2, model.maxSequenceLength 64\]"):
        _size(length=65)


def test_pool_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_SAMPLER_SLOTS", "12")
    monkeypatch.setenv("TG_SAMPLER_KV_BYTES", "")
    assert PoolConfig.from_env() == PoolConfig(slots=12)
    assert PoolConfig(slots=3).merged(PoolConfig.from_env()).slots == 3
    monkeypatch.setenv("TG_SAMPLER_SLOT_LENGTH", "many")
    with pytest.raises(ValueError, match="TG_SAMPLER_SLOT_LENGTH='many' must be an integer"):
        PoolConfig.from_env()


class _FakeGroup:
    """A ``sample_step`` stand-in: finishes each request ``steps[prompt[0]]`` steps after
    admission, refuses prompts starting with 99, fails the call once on request."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int, str | None, bool]] = []
        self.rows: dict[str, int] = {}
        self.weights: str | None = None
        self.fail_next = False
        self.lock = asyncio.Lock()
        self.on_way = self.on_way_max = 0

    async def step(
        self, admit: list[dict[str, Any]], k: int, weights: str | None, reset: bool
    ) -> dict[str, Any]:
        self.on_way += 1  # sent and not back: 2 when the next call waits behind one
        self.on_way_max = max(self.on_way_max, self.on_way)
        try:
            async with self.lock:  # one call at a time, in the order sent, as a Ray actor
                return await self._step(admit, k, weights, reset)
        finally:
            self.on_way -= 1

    async def _step(
        self, admit: list[dict[str, Any]], k: int, weights: str | None, reset: bool
    ) -> dict[str, Any]:
        self.calls.append(([a["prompt"][0] for a in admit], k, weights, reset))
        await asyncio.sleep(0.002)  # a chunk takes time: requests arrive during it
        if reset:
            self.rows.clear()
        if self.fail_next:
            self.fail_next = False
            self.rows.clear()
            raise RuntimeError("boom")
        assert not self.rows or weights == self.weights, "two weights in one batch"
        self.weights = weights
        failed = {}
        for a in admit:
            assert isinstance(a["seed"], int)  # the scheduler fixes a seed for every rank
            if a["prompt"][0] == 99:
                failed[a["id"]] = "prompt 0: refused"
            else:
                self.rows[a["id"]] = a["max_tokens"]
        finished: dict[str, Any] = {}
        for rid in list(self.rows):
            self.rows[rid] -= k
            if self.rows[rid] <= 0:
                del self.rows[rid]
                finished[rid] = {"sequences": [], "prompt_logprobs": None}
        return {
            "finished": finished,
            "failed": failed,
            "active_rows": len(self.rows),
            "slots": 4,
            "length": 50,
        }


def test_scheduler_sends_what_the_pool_cannot_hold_to_the_one_shot_path() -> None:
    async def main() -> tuple[list[int], list[int], list[Any]]:
        group = _FakeGroup()
        overflowed: list[int] = []
        served: list[int] = []
        sched = ContinuousScheduler(
            group.step, overflow=lambda job: overflowed.append(job.request["prompt"][0])
        )
        sched.start()

        def job(first: int, n: int, max_tokens: int) -> ContinuousJob:
            request = {"prompt": [first] * 10, "max_tokens": max_tokens, "num_samples": n}
            return ContinuousJob(None, request, lambda r, e: served.append(first))

        for j in (job(1, 4, 40), job(2, 5, 4), job(3, 1, 41), job(4, 2, 4)):
            sched.put(j)
        for _ in range(3000):
            await asyncio.sleep(0.001)
            if len(served) == 2:
                break
        await sched.stop()
        return overflowed, served, group.calls

    overflowed, served, calls = asyncio.run(main())
    assert overflowed == [2, 3]  # 5 rows > 4 slots; 10 + 41 > 50 positions
    assert sorted(served) == [1, 4]
    assert calls[0] == ([], 0, None, False)  # the pool's size is read first


def test_scheduler_order_weights_and_failures() -> None:
    async def main() -> dict[str, Any]:
        group = _FakeGroup()
        sched = ContinuousScheduler(group.step, steps=8, steps_busy=2)
        sched.start()
        order: list[int] = []
        errors: dict[int, BaseException] = {}

        def job(first: int, weights: str | None, max_tokens: int) -> ContinuousJob:
            def done(result: dict[str, Any] | None, exc: BaseException | None) -> None:
                order.append(first)
                if exc is not None:
                    errors[first] = exc

            request = {"prompt": [first], "max_tokens": max_tokens, "seed": None}
            return ContinuousJob(weights, request, done)

        sched.put(job(1, "w1", 400))  # long
        await asyncio.sleep(0.01)
        sched.put(job(2, "w1", 2))  # joins the running batch, finishes first
        sched.put(job(3, "w2", 2))  # other weights: waits for w1 to drain
        sched.put(job(4, "w1", 2))  # behind 3: does not overtake it
        sched.put(job(99, "w2", 2))  # refused by the group (after 4: arrival order)
        for _ in range(3000):
            await asyncio.sleep(0.001)
            if len(order) == 5:
                break
        group.fail_next = True
        sched.put(job(5, "w1", 4))
        for _ in range(3000):
            await asyncio.sleep(0.001)
            if len(order) == 6:
                break
        sched.put(job(6, "w1", 4))  # after a failed call: reset, then served
        for _ in range(3000):
            await asyncio.sleep(0.001)
            if len(order) == 7:
                break
        await sched.stop()
        return {"order": order, "errors": errors, "calls": group.calls}

    out = asyncio.run(main())
    assert out["order"] == [2, 1, 3, 4, 99, 5, 6], out
    assert isinstance(out["errors"][99], ServiceError) and "refused" in str(out["errors"][99])
    assert str(out["errors"].get(5)) == "boom" and 6 not in out["errors"], str(out["calls"])
    calls = out["calls"]
    assert [c[0] for c in calls if c[0]] == [[1], [2], [3], [4], [99], [5], [6]]
    # the call after the failure resets the workers' rows; no other call does
    assert [c[0] for c in calls if c[3]] == [[6]]
    assert {c[2] for c in calls if 3 in c[0]} == {"w2"}


def _failed(into: list[BaseException | None], _: Any, exc: BaseException | None) -> None:
    into.append(exc)


def test_scheduler_stopped_mid_sample_drops_its_rows_from_the_workers() -> None:
    """A server stopped while its rows decode leaves the group's engine empty (one last call
    with reset, after the call the stop cut off), so the next server's weights are served;
    a server stopped idle makes no call."""

    async def main() -> tuple[_FakeGroup, _FakeGroup]:
        busy, idle = _FakeGroup(), _FakeGroup()
        for group in (busy, idle):
            sched = ContinuousScheduler(group.step, steps=2, steps_busy=2)
            sched.start()
            failures: list[BaseException | None] = []
            if group is busy:
                request = {"prompt": [1], "max_tokens": 10_000, "seed": None}
                sched.put(ContinuousJob("w1", request, functools.partial(_failed, failures)))
                for _ in range(3000):
                    await asyncio.sleep(0.001)
                    if group.rows:
                        break
            await sched.stop()
            assert not failures or isinstance(failures[0], ServiceError)
        return busy, idle

    busy, idle = asyncio.run(main())
    assert busy.rows == {} and busy.calls[-1] == ([], 0, None, True), busy.calls[-3:]
    assert idle.calls == []


def test_settle_waits_for_a_burst_and_not_for_a_lone_request() -> None:
    """The first request of a burst waits while the others keep arriving (the SDK sends a
    step's concurrent samples milliseconds apart), at most GATHER_MAX_S; a lone one waits
    one step."""
    from tgruntime.service.continuous import settle

    async def burst(n: int, gap_s: float) -> tuple[int, float]:
        q: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send() -> None:
            for i in range(n):
                await asyncio.sleep(gap_s)
                q.put_nowait(i)

        sender = loop.create_task(send())
        t0 = loop.time()
        await settle(q, step_s=0.02, max_s=1.0)
        waited = loop.time() - t0
        await sender
        return q.qsize(), waited

    got, _ = asyncio.run(burst(5, 0.005))  # arrivals 5 ms apart, steps of 20 ms: all caught
    assert got == 5
    got, waited = asyncio.run(burst(0, 0.0))  # nothing follows: one step, not max_s
    assert got == 0 and waited < 0.5


def test_scheduler_chunks_grow_while_nothing_arrives() -> None:
    """A lone long request: the call that admits it runs ``steps_busy`` steps, then each quiet
    call doubles the chunk from ``steps`` up to ``steps_max``; an arrival starts over."""

    async def main() -> list[Any]:
        group = _FakeGroup()
        sched = ContinuousScheduler(group.step, steps=8, steps_busy=2, steps_max=32)
        sched.start()
        done: list[int] = []

        def job(first: int, max_tokens: int) -> ContinuousJob:
            request = {"prompt": [first], "max_tokens": max_tokens, "seed": None}
            return ContinuousJob(None, request, lambda r, e: done.append(first))

        sched.put(job(1, 2 + 8 + 16 + 32 + 32))
        for _ in range(3000):
            await asyncio.sleep(0.001)
            if done:
                break
        sched.put(job(2, 2 + 8))
        for _ in range(3000):
            await asyncio.sleep(0.001)
            if len(done) == 2:
                break
        await sched.stop()
        assert group.on_way_max == 1  # one call on its way at a time
        return group.calls

    calls = asyncio.run(main())
    assert [c[1] for c in calls] == [2, 8, 16, 32, 32, 2, 8]
    assert all(not c[0] for c in calls if c[1] not in (2,))  # only the busy calls admit
    with pytest.raises(ValueError, match="steps_max"):
        ContinuousScheduler(_FakeGroup().step, steps=16, steps_max=8)
