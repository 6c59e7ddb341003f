"""``ContinuousSamplingMixin``: the ``sampler_pool`` and ``sample_step`` group methods.

Continuous batching driven in chunks (docs/sampling.md, "Continuous batching"): the caller
(the service's scheduler) calls ``sample_step(admit, max_steps)`` on every rank
(``ONE_TO_ALL``): the new requests are queued, the ``SlotEngine`` admits what fits, runs up to
``max_steps`` decode steps and returns the requests that finished; the rows still decoding
stay in the workers' pool for the next call. Ray runs an actor's calls one at a time, so
training calls interleave between chunks, never inside one.

Full-weight groups: one weights per engine (``weights``: the training weights, or a
snapshot held swapped in between chunks); a call with other weights while rows decode is
refused (the scheduler waits for the rows to drain).

LoRA groups: every request names its own adapter (its ``weights`` field: a snapshot name or
directory, as ``sample_batch``'s entries; absent: the call's ``weights``; None: the base
model without adapters, as in ``sample_batch``; the active run's live adapters are not
served here, they change under training between chunks). Rows of different adapters decode
in one batch (``continuous.RowAdapters``: per-row ``MultiLora`` deltas; the stack is rebuilt
with the union of the adapters in use when a request brings a new one, never waiting for the
rows to drain). During a chunk the active run's hooks are off and the stack's on; after it,
exactly the active run's again. A request whose adapter cannot be resolved fails alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from tgruntime.controller import Dispatch, register
from tgruntime.trainer.engine import TrainEngine
from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.multi import MultiLora
from tgruntime.trainer.sampling.continuous import RowAdapters, SlotEngine
from tgruntime.trainer.sampling.decoder import unwrap_gpt
from tgruntime.trainer.sampling.generate import Sampler, graphs_allowed
from tgruntime.trainer.sampling.params import SamplingParams, check_prompts
from tgruntime.trainer.sampling.pool import PoolConfig, PoolSize
from tgruntime.trainer.sampling.snapshots import SnapshotStore

__all__ = ["ContinuousSamplingMixin"]

_REQUEST_FIELDS = frozenset(
    {
        "id",
        "prompt",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stop",
        "num_samples",
        "prompt_logprobs",
        "logprob_options",
        "weights",
    }
)

_RESOLVE_ERRORS = (KeyError, ValueError, FileNotFoundError)
"""What resolving a weights name may raise for a bad name (the request fails alone)."""


def _message(exc: Exception) -> str:
    """An exception's message (a KeyError's without the repr quotes)."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)


def _graphs_on(sampler: Sampler) -> bool:
    """Whether the continuous engine replays CUDA graphs: as the one-shot sampler does
    (``generate.graphs_allowed``: on a GPU at tensor and pipeline size 1 by default)."""
    return graphs_allowed(sampler.decoder)


class ContinuousSamplingMixin:
    """Continuous-batching group methods for a worker that owns a ``TrainEngine``."""

    _slot_engine: SlotEngine | None = None
    _pool_config: PoolConfig = PoolConfig()
    # The snapshot swapped into the live parameters between chunks (the snapshot's tensors,
    # and the swap to close): a run of chunks over one snapshot swaps it in once, not once a
    # chunk (each swap copies the rank's parameters three times). Any other group method
    # puts the training weights back first (``_training_weights``, from ``_engine()``).
    _held: tuple[dict[str, torch.Tensor], contextlib.ExitStack] | None = None
    _in_chunk: bool = False
    _adapter_s: float = 0.0  # a LoRA group's calls: seconds resolving requests' adapters

    def _training_weights(self) -> None:
        """Put the training weights back if a snapshot is held between sampling chunks;
        ``_engine()`` calls this for every group method but ``sample_step`` itself."""
        if not self._in_chunk:
            self._drop_held()

    def _drop_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[1].close()

    def _hold(
        self, module: torch.nn.Module, snapshot: dict[str, torch.Tensor], store: SnapshotStore
    ) -> None:
        if self._held is not None and self._held[0] is snapshot:
            return
        self._drop_held()
        stack = contextlib.ExitStack()
        stack.enter_context(store.swapped_in(module, snapshot))
        self._held = (snapshot, stack)

    def _engine(self) -> TrainEngine:  # MegatronTrainer provides the real one
        raise NotImplementedError

    def _sampling(self) -> tuple[Sampler, SnapshotStore]:  # SamplingMixin provides it
        raise NotImplementedError

    def _snapshot_adapters(self, engine: TrainEngine, weights: str) -> LoraAdapters:
        raise NotImplementedError  # SamplingMixin provides it

    def _hooks_swapped(
        self, engine: TrainEngine, other: LoraAdapters | MultiLora | None
    ) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError  # SamplingMixin provides it

    def _continuous(self, engine: TrainEngine) -> SlotEngine:
        slot_engine = self._slot_engine
        if slot_engine is None:
            sampler, _ = self._sampling()
            d = sampler.decoder
            per_position = 2 * len(d.layers) * d.groups * d.head_dim * d.dtype.itemsize
            free = torch.cuda.mem_get_info()[0] if d.device.type == "cuda" else None
            size = PoolSize.resolve(
                self._pool_config.merged(PoolConfig.from_env()),
                max_sequence_length=d.max_sequence_length,
                bytes_per_position=per_position,
                free_bytes=free,
            )
            lora = None
            if engine.adapters is not None:
                lora = RowAdapters(unwrap_gpt(engine.state.module), size.slots)
            slot_engine = SlotEngine(
                d,
                size,
                cuda_graphs=_graphs_on(sampler),
                lora=lora,
                window=int(os.environ.get("TG_SAMPLER_WINDOW", "16")),
            )
            self._slot_engine = slot_engine
        return slot_engine

    def _capture_graphs(self, engine: TrainEngine) -> int:
        """The warm-up's part (``warm_up.py``): allocate the pool and capture its graphs now
        (``SlotEngine.capture_buckets``), when the engine would use CUDA graphs; the graphs
        captured. A LoRA group captures over a stack of the active run's adapters, with that
        run's hooks off meanwhile."""
        sampler, _ = self._sampling()
        if not _graphs_on(sampler):
            return 0
        slot_engine = self._continuous(engine)
        if slot_engine.lora is None:
            self._drop_held()
            return slot_engine.capture_buckets()
        with self._hooks_swapped(engine, None), slot_engine.lora.attached():
            return slot_engine.capture_buckets(engine.adapters)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sampler_pool(
        self,
        slots: int | None = None,
        length: int | None = None,
        kv_bytes: int | None = None,
        allocate: bool = True,
    ) -> dict[str, Any]:
        """Size the continuous engine's KV pool (None: ``TG_SAMPLER_*`` or the default) and
        allocate it now (``allocate=False``: free the pool now; the next ``sample_step``
        allocates it again); refused while rows decode. The value: the pool's ``info``
        (slots, length, kv_bytes, budget, ...)."""
        engine = self._engine()
        current = self._slot_engine
        if current is not None and current.busy:
            raise ValueError(
                "sampler_pool: the sampler's pool has rows decoding; resize it when idle"
            )
        config = PoolConfig(slots=slots, length=length, kv_bytes=kv_bytes)
        old = (self._slot_engine, self._pool_config)
        self._slot_engine, self._pool_config = None, config
        if not allocate:
            return {"allocated": False}
        try:
            slot_engine = self._continuous(engine)
        except Exception:
            self._slot_engine, self._pool_config = old  # a refused size keeps the old pool
            raise
        del old
        return {"allocated": True, **slot_engine.info()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sample_step(
        self,
        admit: list[dict[str, Any]],
        *,
        max_steps: int,
        weights: str | None = None,
        reset: bool = False,
    ) -> dict[str, Any]:
        """Queue ``admit`` (dicts: ``id`` and ``sample``'s parameters, one prompt each), run
        up to ``max_steps`` decode steps for every active row, and return ``{"finished":
        {id: sample's per-prompt dict + "engine": steps}, "failed": {id: message}, ...the
        pool's info}``. ``weights`` as ``sample``'s; one weights at a time: a call with other
        weights while rows decode is refused. On a LoRA group each request may name its own
        ``weights`` (the module docstring; None: the base), rows of any adapters decode
        together. ``reset``: drop every row first."""
        self._in_chunk = True  # _engine() keeps a held snapshot swapped in
        began = time.perf_counter()
        try:
            out = self._sample_step(admit, max_steps, weights, reset)
        finally:
            self._in_chunk = False
        return {**out, "worker_s": round(time.perf_counter() - began, 5)}  # this call's

    def _sample_step(
        self, admit: list[dict[str, Any]], max_steps: int, weights: str | None, reset: bool
    ) -> dict[str, Any]:
        engine = self._engine()
        slot_engine = self._continuous(engine)
        if reset:
            slot_engine.reset()
        if not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"sample_step: max_steps must be an integer >= 0, not {max_steps!r}")
        if slot_engine.lora is not None:
            return self._lora_step(engine, slot_engine, admit, max_steps, weights)
        if slot_engine.busy and slot_engine.weights != weights:
            raise ValueError(
                f"sample_step: the sampler is decoding rows of weights {slot_engine.weights!r}; "
                f"requests for {weights!r} wait until they finish (the scheduler's job)"
            )
        failed: dict[str, str] = {}
        _, store = self._sampling()
        snapshot = None
        if weights is not None and (admit or slot_engine.busy):
            try:
                snapshot = store.resolve(weights, engine.mesh_info, engine.device)
            except (KeyError, ValueError, FileNotFoundError) as exc:
                if slot_engine.busy:
                    raise
                why = _message(exc)
                return {"finished": {}, "failed": {str(r.get("id")): why for r in admit}}
        for request in admit:
            rid = str(request.get("id"))
            try:
                if isinstance(request, dict) and request.get("weights", weights) != weights:
                    raise ValueError(
                        "sample_step: a request's own weights need a LoRA group; on a "
                        "full-weight group pass weights= to the call (one weights a call)"
                    )
                self._submit(engine, slot_engine, request)
            except (ValueError, TypeError) as exc:
                failed[rid] = str(exc)
        if slot_engine.busy:
            slot_engine.weights = weights
        try:
            if snapshot is None:
                self._drop_held()
            else:  # swapped in until the rows drain or another group method runs
                self._hold(engine.state.module, snapshot, store)
            done = slot_engine.run(max_steps)
        except BaseException:
            slot_engine.reset()  # the rows' state is unknown now; the caller fails them
            self._drop_held()
            raise
        if not slot_engine.busy:
            self._drop_held()
        return {"finished": dict(done), "failed": failed, **slot_engine.info()}

    def _lora_step(
        self,
        engine: TrainEngine,
        slot_engine: SlotEngine,
        admit: list[dict[str, Any]],
        max_steps: int,
        weights: str | None,
    ) -> dict[str, Any]:
        """``sample_step`` on a LoRA group: each request with its own adapter, one batch."""
        assert slot_engine.lora is not None
        failed: dict[str, str] = {}
        began = time.perf_counter()
        for request in admit:
            rid = str(request.get("id")) if isinstance(request, dict) else str(request)
            try:
                adapter = self._request_adapter(engine, request, weights)
                self._submit(engine, slot_engine, request, adapter)
            except (TypeError, *_RESOLVE_ERRORS) as exc:
                failed[rid] = _message(exc)
        self._adapter_s += time.perf_counter() - began
        try:
            with self._hooks_swapped(engine, None), slot_engine.lora.attached():
                done = slot_engine.run(max_steps)
        except BaseException:
            slot_engine.reset()  # the rows' state is unknown now; the caller fails them
            raise
        return {
            "finished": dict(done),
            "failed": failed,
            **slot_engine.info(),
            "adapter_s": round(self._adapter_s, 4),
        }

    def _request_adapter(
        self, engine: TrainEngine, request: Any, weights: str | None
    ) -> LoraAdapters | None:
        """The adapter set a LoRA group's request names (its ``weights``, else the call's;
        None: the base model)."""
        if not isinstance(request, dict):
            raise ValueError("sample_step: each request is a dict with 'id' and 'prompt'")
        name = request.get("weights", weights)
        if name is None:
            return None
        if not isinstance(name, str) or not name:
            raise ValueError(
                "sample_step: a request's weights must be a snapshot name, a directory or "
                f"None for the base model, not {name!r}"
            )
        return self._snapshot_adapters(engine, name)

    @staticmethod
    def _submit(
        engine: TrainEngine,
        slot_engine: SlotEngine,
        request: Any,
        adapter: LoraAdapters | None = None,
    ) -> None:
        if not isinstance(request, dict) or "id" not in request or "prompt" not in request:
            raise ValueError("sample_step: each request is a dict with 'id' and 'prompt'")
        unknown = set(request) - _REQUEST_FIELDS
        if unknown:
            raise ValueError(f"sample_step: unknown request fields {sorted(unknown)}")
        model = engine.spec.model
        kwargs = {k: v for k, v in request.items() if k not in ("id", "prompt", "weights")}
        if "max_tokens" not in kwargs:
            raise ValueError("sample_step: max_tokens is required")
        params = SamplingParams.build(vocab_size=model.vocab_size, **kwargs)
        (prompt,) = check_prompts(
            [request["prompt"]],
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            max_tokens=params.max_tokens,
            logprobs=params.logprobs,
        )
        slot_engine.submit(str(request["id"]), prompt, params, adapter)
