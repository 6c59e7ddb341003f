"""``SamplingMixin``: the ``save_sampler_weights`` and ``sample`` group methods.

Mixed into ``MegatronTrainer`` (which provides ``_engine()``). Both are ``ONE_TO_ALL``:
every rank takes part (tensor-parallel collectives), every rank returns the same value.
Data-parallel replicas each generate the whole request (the same tokens).
"""

from __future__ import annotations

from typing import Any

from tgruntime.controller import Dispatch, register
from tgruntime.trainer.engine import TrainEngine
from tgruntime.trainer.sampling.generate import Sampler
from tgruntime.trainer.sampling.params import SamplingParams, check_prompts
from tgruntime.trainer.sampling.snapshots import SnapshotStore

__all__ = ["SamplingMixin"]


class SamplingMixin:
    """Sampling group methods for a worker that owns a ``TrainEngine``."""

    def _engine(self) -> TrainEngine:  # MegatronTrainer provides the real one
        raise NotImplementedError

    def _sampling(self) -> tuple[Sampler, SnapshotStore]:
        sampler: Sampler | None = getattr(self, "_sampler", None)
        store: SnapshotStore | None = getattr(self, "_snapshot_store", None)
        if sampler is None or store is None:
            engine = self._engine()
            if getattr(engine, "adapters", None) is not None:
                # the sampler reads the base weights directly: it would ignore the adapters
                raise NotImplementedError(
                    "this group trains LoRA adapters, and sampling from adapters is not wired "
                    "yet (issue 22); export them (export_lora, PEFT format) and sample there"
                )
            sampler = Sampler(engine.state.module)
            store = SnapshotStore()
            self._sampler, self._snapshot_store = sampler, store
        return sampler, store

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_sampler_weights(self, name: str, path: str | None = None) -> dict[str, Any]:
        """Keep a copy of the current weights under ``name`` (and write it to ``path``)."""
        engine = self._engine()
        _, store = self._sampling()
        return store.save(name, engine.state.module, engine.mesh_info, path)

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
    ) -> list[dict[str, Any]]:
        """Generate from the training weights (``weights=None``) or a saved snapshot."""
        engine = self._engine()
        model = engine.spec.model
        params = SamplingParams.build(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=stop,
            num_samples=num_samples,
            prompt_logprobs=prompt_logprobs,
            vocab_size=model.vocab_size,
        )
        rows = check_prompts(
            prompts,
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            max_tokens=params.max_tokens,
        )
        sampler, store = self._sampling()
        if weights is None:
            return sampler.generate(rows, params)
        snapshot = store.resolve(weights, engine.mesh_info, engine.device)
        with store.swapped_in(engine.state.module, snapshot):
            return sampler.generate(rows, params)
