"""The optimizer of a LoRA run: AdamW over the adapter parameters only.

:func:`build_adapter_training_state` returns a :class:`AdapterTrainingState` (a
``TrainingState``, so the engine's primitives drive it unchanged) whose optimizer is the
trainer's :class:`~tgruntime.trainer.optim.LocalOptimizer` (torch AdamW, the same
parameter groups, the tensor-parallel-aware global grad norm) built over the
:class:`LoraAdapters` module, so Adam's moments exist for ``A`` and ``B`` only. The model
is called bare (no megatron DDP: its buffers would be for the frozen base); the adapters'
gradients are averaged over data parallelism by the schedule's finalize hook, which this
installs on the model's config.

Memory: :func:`adam_state_bytes` is what AdamW keeps per parameter set (two fp32 moments
and a step count per tensor); :func:`optimizer_state_bytes` measures an optimizer's actual
state tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from tgapi import OptimizerSpec
from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.optim import LocalOptimizer, TrainingState
from tgruntime.trainer.schedule import finalize_grads_local

__all__ = [
    "AdapterTrainingState",
    "adam_state_bytes",
    "bind_adapter_grads",
    "build_adapter_training_state",
    "optimizer_state_bytes",
]


@dataclasses.dataclass(frozen=True)
class AdapterTrainingState(TrainingState):
    """``TrainingState`` of a LoRA run: ``module`` is the frozen base, ``adapters`` trains."""

    adapters: LoraAdapters | None = None

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        assert self.adapters is not None
        for p in self.adapters.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def build_adapter_training_state(
    module: torch.nn.Module, *, adapters: LoraAdapters, config: Any, spec: OptimizerSpec
) -> AdapterTrainingState:
    """AdamW over ``adapters`` only, for the frozen ``module`` (its ``TransformerConfig``
    ``config`` gets the finalize hook that averages the adapters' gradients over DP).

    Works on CPU and GPU (torch AdamW on the float32 adapters; no DDP, no loss scaling:
    do not use it with fp16).
    """
    if any(p.requires_grad for p in module.parameters()):
        raise ValueError("freeze the base model first (lora.freeze_base)")
    if getattr(config, "fp16", False):
        raise ValueError("LoRA training needs bf16 or fp32 (fp16 would need loss scaling)")
    optimizer = LocalOptimizer(adapters, spec)
    bind_adapter_grads(config, adapters)
    return AdapterTrainingState(model=module, module=module, optimizer=optimizer, adapters=adapters)


def bind_adapter_grads(config: Any, adapters: LoraAdapters) -> None:
    """Make the schedule's finalize hook (on the model's ``TransformerConfig``) average
    ``adapters``' gradients over data parallelism; called again when another run's adapters
    become the active ones (``lora.runs``)."""

    def finalize(model: list[torch.nn.Module], *args: Any, **kwargs: Any) -> None:
        finalize_grads_local([adapters])

    config.finalize_model_grads_func = finalize
    config.no_sync_func = None
    config.grad_scale_func = None


def adam_state_bytes(params: Iterable[torch.Tensor], *, state_dtype_bytes: int = 4) -> int:
    """Bytes AdamW's state takes for ``params``: ``exp_avg`` and ``exp_avg_sq`` in the
    state dtype (float32 moments, as torch's AdamW on fp32 params and megatron's mixed
    precision keep them) plus one fp32 step count per tensor. megatron's mixed-precision
    optimizer also keeps an fp32 master copy of bf16 weights (+4 bytes/parameter), not
    counted here."""
    tensors = list(params)
    return sum(2 * t.numel() * state_dtype_bytes + 4 for t in tensors)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors an optimizer's state holds now (0 before its first step)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
