"""The sampling queue. By default requests go to the continuous-batching scheduler
(``continuous.py``): a request joins the rows decoding in the workers at their next chunk,
whatever its parameters (``TG_CONTINUOUS_BATCHING=0`` turns it off). On a LoRA group
(``multi_lora``) every request carries its adapter (its ``weights``: a snapshot, or None for
the base) and the scheduler sees them all as one weights, so rows of every adapter decode in
one batch (the workers' ``sample_step`` gives each row its own adapter).
Otherwise (and for a request the pool can never hold) concurrent ``asample`` requests with
the same weights and parameters go to the group as one ``TrainerClient.sample`` call that
runs to completion; on a LoRA group the requests with the same parameters go as one
``sample_batch`` call whatever their adapters: one forward pass serves every adapter
(docs/lora.md)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tgruntime.driver.trainer_client import sampling_params
from tgruntime.service.backend import Backend
from tgruntime.service.continuous import (
    GATHER_MAX_S,
    ContinuousJob,
    ContinuousScheduler,
    settle,
)

log = logging.getLogger("tgruntime.service.sampling")

# (weights, max_tokens, temperature, top_k, top_p, seed, stop, num_samples, prompt_logprobs,
#  LogprobOptions)
Key = tuple[Any, ...]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


@dataclass
class SampleJob:
    key: Key
    prompt: list[int]
    done: Callable[[dict[str, Any] | None, BaseException | None], None]


class SampleQueue:
    def __init__(
        self,
        backend: Backend,
        *,
        multi_lora: bool = False,
        gather_s: float = 0.002,
        continuous: bool | None = None,
    ) -> None:
        self.backend = backend
        self.multi_lora = multi_lora
        self.gather_s = gather_s  # how long the first request waits for others to join it
        self._queue: asyncio.Queue[SampleJob] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._calls = 0
        self._prompts = 0
        if continuous is None:
            continuous = os.environ.get("TG_CONTINUOUS_BATCHING", "1") != "0"
        self.continuous: ContinuousScheduler | None = None
        if continuous:
            self.continuous = ContinuousScheduler(
                self._step,
                gather_s=gather_s,
                overflow=self._one_shot,
                steps_max=_env_int("TG_SAMPLER_CHUNK_MAX", 64),
            )

    @property
    def calls(self) -> int:
        """Group calls made (``sample`` / ``sample_batch``, or ``sample_step`` chunks)."""
        return self._calls + (self.continuous.calls if self.continuous else 0)

    @property
    def call_s(self) -> float:
        """Seconds spent awaiting ``sample_step`` chunks (continuous batching only)."""
        return self.continuous.call_s if self.continuous else 0.0

    @property
    def worker_s(self) -> float:
        """Of ``call_s``, the seconds inside the workers' ``sample_step`` (the rest: Ray's)."""
        return self.continuous.worker_s if self.continuous else 0.0

    @property
    def engine(self) -> dict[str, Any]:
        """The engine's pool info as of the last ``sample_step`` (``SlotEngine.info``)."""
        return dict(self.continuous.last) if self.continuous else {}

    @property
    def prompts(self) -> int:
        return self._prompts + (self.continuous.prompts if self.continuous else 0)

    def _one_shot(self, job: ContinuousJob) -> None:
        """A request the continuous pool can never hold (num_samples over its slots, or
        longer than a slot): the one-shot path, as before."""
        self._queue.put_nowait(job.origin)

    async def _step(
        self, admit: list[dict[str, Any]], max_steps: int, weights: str | None, reset: bool
    ) -> dict[str, Any]:
        future = self.backend.client.sample_step(
            admit, max_steps=max_steps, weights=weights, reset=reset
        )
        out: dict[str, Any] = await self.backend.wait(future)
        return out

    def start(self) -> None:
        if self.continuous is not None:
            self.continuous.start()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.continuous is not None:
            await self.continuous.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def put(self, job: SampleJob) -> None:
        if self.continuous is None:
            self._queue.put_nowait(job)
            return
        request = {"prompt": job.prompt, **_params(job.key)}
        if self.multi_lora:  # the adapter is per request: one weights for the scheduler
            request["weights"] = job.key[0]
            self.continuous.put(ContinuousJob(None, request, job.done, origin=job))
            return
        self.continuous.put(ContinuousJob(job.key[0], request, job.done, origin=job))

    async def _run(self) -> None:
        while True:
            jobs = [await self._queue.get()]
            await settle(self._queue, step_s=self.gather_s, max_s=GATHER_MAX_S)
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            groups: dict[Key, list[SampleJob]] = {}
            for job in jobs:
                # a LoRA group batches every adapter together: the weights are per prompt
                key = (None, *job.key[1:]) if self.multi_lora else job.key
                groups.setdefault(key, []).append(job)
            await asyncio.gather(*(self._one_call(k, g) for k, g in groups.items()))

    async def _one_call(self, key: Key, jobs: list[SampleJob]) -> None:
        weights = key[0]
        self._calls += 1
        self._prompts += len(jobs)
        params = _params(key)
        prompts = [j.prompt for j in jobs]
        client = self.backend.client
        try:
            if self.multi_lora:
                future = client.sample_batch(prompts, [j.key[0] for j in jobs], **params)
            else:
                future = client.sample(prompts, weights=weights, **params)
            results = await self.backend.wait(future)
        except Exception as exc:
            for j in jobs:
                j.done(None, exc)
            return
        for j, r in zip(jobs, results, strict=True):
            j.done(r, None)


def _params(key: Key) -> dict[str, Any]:
    """The sampling parameters of a queue key (everything but its weights), as the workers'
    ``sample`` / ``sample_step`` take them."""
    _, max_tokens, temperature, top_k, top_p, seed, stop, n, plp, scoring = key
    return sampling_params(
        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop=stop, num_samples=n, prompt_logprobs=plp, logprob_options=scoring.as_request(),
    )
