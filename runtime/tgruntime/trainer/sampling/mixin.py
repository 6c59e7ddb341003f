"""``SamplingMixin``: the ``save_sampler_weights``, ``sample``, ``sample_batch`` and
``drop_sampler_weights`` group methods.

Mixed into ``MegatronTrainer`` (which provides ``_engine()``). All are ``ONE_TO_ALL``:
every rank takes part (tensor-parallel collectives), every rank returns the same value.
Data-parallel replicas each generate the whole request (the same tokens).

Full-weight groups snapshot and swap the model's parameters (``SnapshotStore``). LoRA
groups (docs/lora.md, "Sampling from adapters") snapshot the active run's adapters only
(``AdapterSnapshotStore``) and sample by switching forward hooks on the frozen base: the
active run's (``weights=None``), a snapshot's sampling-only adapter set, or per-row
adapters for a mixed batch (``lora.multi.MultiLora``). The active run's hooks are put back
in a ``finally``; its adapters, AdamW state and pending gradient are never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tgruntime.controller import Dispatch, register
from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.engine import TrainEngine
from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.multi import MultiLora
from tgruntime.trainer.sampling.decoder import unwrap_gpt
from tgruntime.trainer.sampling.generate import Sampler
from tgruntime.trainer.sampling.params import SamplingParams, check_prompts
from tgruntime.trainer.sampling.snapshots import (
    AdapterSnapshotStore,
    SnapshotStore,
    param_bytes,
)
from tgruntime.trainer.sampling.stepping import ContinuousSamplingMixin
from tgruntime.trainer.sampling.uniform import ACTIVE_RUN, UniformStacks
from tgruntime.trainer.sampling.weights_budget import WeightsBudget, agree_max, free_memory

__all__ = ["SamplingMixin"]


class SamplingMixin(ContinuousSamplingMixin):
    """Sampling group methods for a worker that owns a ``TrainEngine`` (continuous batching:
    ``ContinuousSamplingMixin``)."""

    _multi_cache: tuple[Any, MultiLora] | None = None  # the last multi-adapter stack, its key
    _uniform: UniformStacks | None = None  # one-shot snapshot sampling's one-slot stacks

    def _engine(self) -> TrainEngine:  # MegatronTrainer provides the real one
        raise NotImplementedError

    # -- state ---------------------------------------------------------------------------
    def _sampler_for(self, engine: TrainEngine) -> Sampler:
        sampler: Sampler | None = getattr(self, "_sampler", None)
        if sampler is None:
            # CUDA graphs replay the hooks of capture time: LoRA calls pass the hook set they
            # attach (``hooks=``), and a graph only serves the set it was captured with
            sampler = Sampler(engine.state.module)
            self._sampler = sampler
        return sampler

    def _sampling(self) -> tuple[Sampler, SnapshotStore]:
        """The sampler and the full-weight snapshot store (a full-weight group)."""
        engine = self._engine()
        store: SnapshotStore | None = getattr(self, "_snapshot_store", None)
        if store is None:
            copy = param_bytes(dict(engine.state.module.named_parameters()))
            store = SnapshotStore(copy_bytes=copy, **self._weights_budget(engine, copy))
            self._snapshot_store = store
        return self._sampler_for(engine), store

    def _adapter_store(self) -> AdapterSnapshotStore:
        store: AdapterSnapshotStore | None = getattr(self, "_adapter_snapshots", None)
        if store is None:
            store = AdapterSnapshotStore(**self._weights_budget(self._engine()))
            self._adapter_snapshots = store
        return store

    @staticmethod
    def _weights_budget(engine: TrainEngine, copy_bytes: int = 0) -> dict[str, Any]:
        """The stores' budget (chosen once, when the rank's first sampler weights are kept)
        and the ranks' agreement on evictions (weights_budget.py)."""
        free, where, sharing = free_memory(engine.device)
        budget = WeightsBudget.resolve(
            engine.spec.training.sampler_weights_memory,
            free_bytes=free,
            where=where,
            ranks_sharing=sharing,
            copy_bytes=copy_bytes,
        )
        device = engine.device

        def agree(value: int) -> int:  # the I/O group as of the call (it may be made again)
            return agree_max(value, group=ckpt.io_group(), device=device)

        return {"budget": budget, "agree": agree}

    def _active_run(self) -> str:
        runs = getattr(self, "_runs", None)
        return str(runs.active) if runs is not None else "default"

    @staticmethod
    def _params(engine: TrainEngine, prompts: Any, **kwargs: Any) -> tuple[list[list[int]], Any]:
        model = engine.spec.model
        params = SamplingParams.build(vocab_size=model.vocab_size, **kwargs)
        rows = check_prompts(
            prompts,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            max_tokens=params.max_tokens,
            logprobs=params.logprobs,
        )
        return rows, params

    @contextlib.contextmanager
    def _hooks_swapped(
        self, engine: TrainEngine, other: LoraAdapters | MultiLora | None
    ) -> Iterator[None]:
        """The active run's hooks off and ``other``'s on (None: the bare base) inside the
        block; exactly the active run's afterwards."""
        active = engine.adapters
        assert active is not None
        was_attached = active.attached
        active.detach()
        try:
            if other is not None:
                other.attach()
            try:
                yield
            finally:
                if other is not None:
                    other.detach()
        finally:
            if was_attached:
                active.attach()

    def _snapshot_adapters(self, engine: TrainEngine, weights: str) -> LoraAdapters:
        assert engine.adapters is not None
        store = self._adapter_store()
        snap = store.resolve(
            weights, mesh=engine.mesh_info, base=engine.base_fingerprint(), device=engine.device
        )
        return store.adapters_for(snap, unwrap_gpt(engine.state.module), engine.adapters.shape)

    # -- group methods ---------------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_sampler_weights(self, name: str, path: str | None = None) -> dict[str, Any]:
        """Keep a copy of the current weights under ``name`` (and write it to ``path``).

        On a LoRA group: the active run's adapters only (the result adds ``run`` and
        ``lora``, the settings)."""
        engine = self._engine()
        if engine.adapters is not None:
            # a stack may hold the snapshot this name replaces (one-slot stacks: refilled
            # in place by the store's version, see UniformStacks)
            self._multi_cache = None
            return self._adapter_store().save(
                name,
                engine.adapters,
                run=self._active_run(),
                base=engine.base_fingerprint(),
                mesh=engine.mesh_info,
                path=path,
            )
        _, store = self._sampling()
        return store.save(name, engine.state.module, engine.mesh_info, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drop_sampler_weights(self, name: str) -> bool:
        """Forget the in-memory snapshot ``name`` (its files stay); False when unknown."""
        engine = self._engine()
        if engine.adapters is not None:
            self._multi_cache = None
            self._uniform_stacks().forget(name)
            return self._adapter_store().drop(name)
        _, store = self._sampling()
        return store.drop(name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sampler_weights_info(self) -> dict[str, Any]:
        """The sampler weights this rank holds in memory: ``names`` (saved or read),
        ``loaded`` (also on disk: the evictable cache), their ``bytes``, and the budget
        (``budget_bytes``, ``budget_source``: spec.training.samplerWeightsMemory); on a LoRA
        group also the one-slot stacks of one-shot snapshot sampling (``uniform_stacks``
        kept, ``uniform_builds`` made, ``uniform_refills`` written in place); ``one_shot``:
        the last one-shot call's device split (``Sampler.last``; empty before one)."""
        engine = self._engine()
        sampler: Sampler | None = getattr(self, "_sampler", None)  # none made here
        one_shot = {
            "one_shot": {} if sampler is None else dict(sampler.last),
            "rank": engine.mesh_info.rank,
        }
        if engine.adapters is not None:
            return {
                **self._adapter_store().resident(),
                "uniform_stacks": len(self._uniform_stacks()),
                "uniform_builds": self._uniform_stacks().builds,
                "uniform_refills": self._uniform_stacks().refills,
                **one_shot,
            }
        _, store = self._sampling()
        return {**store.resident(), **one_shot}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[list[int]] | None = None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        weights: str | None = None,
        logprob_options: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Generate from the training weights (``weights=None``; on a LoRA group: the base
        with the active run's adapters) or a saved snapshot (a name or its directory)."""
        engine = self._engine()
        rows, params = self._params(
            engine,
            prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            num_samples=num_samples,
            prompt_logprobs=prompt_logprobs,
            logprob_options=logprob_options,
        )
        if engine.adapters is not None:
            sampler = self._sampler_for(engine)
            if weights is None:  # the active run's adapters, through a one-slot stack
                return self._generate_one(
                    engine, sampler, rows, params, ACTIVE_RUN, engine.adapters, live=True
                )
            adapters = self._snapshot_adapters(engine, weights)
            return self._generate_one(engine, sampler, rows, params, weights, adapters)
        sampler, store = self._sampling()
        if weights is None:
            return sampler.generate(rows, params)
        snapshot = store.resolve(weights, engine.mesh_info, engine.device)
        with store.swapped_in(engine.state.module, snapshot):
            return sampler.generate(rows, params)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sample_batch(
        self,
        prompts: list[list[int]],
        weights: list[str | None],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[list[int]] | None = None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        logprob_options: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """One batch, one adapter per prompt (a LoRA group): ``weights[i]`` is the adapter
        snapshot (a name or a directory, as ``sample``'s ``weights``) prompt ``i`` is sampled
        with, or None for the base model without adapters. The same sampling parameters for
        every prompt; the result is ``sample``'s, one dict per prompt in order."""
        engine = self._engine()
        if engine.adapters is None:
            raise ValueError(
                "sample_batch: this group trains full weights; per-prompt adapters need a LoRA "
                "group (set spec.lora); use sample(weights=...) for a full-weight snapshot"
            )
        rows, params = self._params(
            engine,
            prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            num_samples=num_samples,
            prompt_logprobs=prompt_logprobs,
            logprob_options=logprob_options,
        )
        if isinstance(weights, str) or not isinstance(weights, list | tuple):
            raise ValueError(
                "sample_batch: weights must be a list with one entry per prompt (a snapshot "
                f"name or directory, or None for the base model), not {weights!r}"
            )
        if len(weights) != len(rows):
            raise ValueError(
                f"sample_batch: weights has {len(weights)} entries for {len(rows)} prompts; "
                "give one per prompt (None for the base model)"
            )
        for i, w in enumerate(weights):
            if w is not None and (not isinstance(w, str) or not w):
                raise ValueError(
                    f"sample_batch: weights[{i}] must be a snapshot name, a directory or None, "
                    f"not {w!r}"
                )
        names = list(dict.fromkeys(w for w in weights if w is not None))
        adapter_sets = [self._snapshot_adapters(engine, w) for w in names]  # refusals first
        sampler = self._sampler_for(engine)
        distinct = set(weights)
        if len(distinct) == 1:  # one adapter (or none) for the whole batch
            if not adapter_sets:
                with self._hooks_swapped(engine, None):
                    return sampler.generate(rows, params)
            return self._generate_one(engine, sampler, rows, params, names[0], adapter_sets[0])
        # two or more entries, so at least one adapter: per-row deltas (slot 0: the base)
        multi = self._multi(unwrap_gpt(engine.state.module), names, adapter_sets)
        slot = {name: i + 1 for i, name in enumerate(names)}
        multi.set_rows(
            [slot[w] if w is not None else 0 for w in weights for _ in range(num_samples)]
        )
        with self._hooks_swapped(engine, multi):
            return sampler.generate(rows, params, scope=multi.narrowed, hooks=multi)

    def _generate_one(
        self,
        engine: TrainEngine,
        sampler: Sampler,
        rows: list[list[int]],
        params: Any,
        name: str,
        adapters: LoraAdapters,
        *,
        live: bool = False,
    ) -> list[dict[str, Any]]:
        """Every row with snapshot ``name``'s adapters (``live``: the active run's, name
        :data:`ACTIVE_RUN`): a one-slot stack with a uniform row map, so that the decode step
        takes the lean layers with the stack's deltas (the adapters' own hooks send it through
        the modules: the engine's LoRA sampling took 1.96x as long that way on the seed shape,
        1.28x on the 8 B block, docs/tinker.md)
        and the samples of a prompt still share its prefill (no row scope). The stacks are
        kept and refilled in place (:class:`UniformStacks`): CUDA graphs are keyed by the
        stack, so calls alternating between a few snapshots, or a new snapshot every RL
        step, capture nothing again for the stack's sake. They are apart from the per-row
        stack (a graph captured over a uniform map must never replay for a per-row one)."""
        module = unwrap_gpt(engine.state.module)
        multi = self._uniform_stacks().get(
            module, name, self._adapter_store().version, adapters, live=live
        )
        with self._hooks_swapped(engine, multi):
            return sampler.generate(rows, params, hooks=multi)

    def _warm_generate(self, prompts: list[list[int]], params: Any) -> Any:
        """The warm-up's one-shot generation (warm_up.py) down the path ``sample`` takes:
        a LoRA group's through the active run's one-slot stack (the lean layers' "uniform"
        step and its graphs compile here, not in the first ``sample`` call: ~4-5 s on an H100),
        a full-weight group's on the training weights."""
        engine = self._engine()
        sampler = self._sampler_for(engine)
        if engine.adapters is None:
            return sampler.generate(prompts, params)
        return self._generate_one(
            engine, sampler, prompts, params, ACTIVE_RUN, engine.adapters, live=True
        )

    def _uniform_stacks(self) -> UniformStacks:
        if self._uniform is None:
            self._uniform = UniformStacks()
        return self._uniform

    def _multi(self, module: Any, names: list[str], adapter_sets: list[LoraAdapters]) -> MultiLora:
        """The stacked adapters of ``names`` (the last combination is kept until a snapshot
        changes)."""
        key = (tuple(names), self._adapter_store().version)
        cached = self._multi_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        self._multi_cache = None  # free the old stack first
        multi = MultiLora(module, adapter_sets)
        self._multi_cache = (key, multi)
        return multi
