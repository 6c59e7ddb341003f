"""The optimizer (AdamW, global-norm clipping, weight decay) and the model wrapper it needs.

GPU: megatron's own stack. The model is wrapped in megatron's ``DistributedDataParallel``
(contiguous fp32 gradient buffers, data-parallel all-reduce in ``finalize_model_grads``)
and ``get_megatron_optimizer`` builds a mixed-precision AdamW (fp32 main params for a
bf16/fp16 model; TE/apex fused Adam when present, else ``torch.optim.AdamW``).

CPU: megatron's DDP buffers, ``FP32Optimizer`` and grad-norm kernels allocate on CUDA
unconditionally, so :class:`LocalOptimizer` implements the part of the
``MegatronOptimizer`` interface the engine uses (``zero_grad``, ``step`` ->
``(ok, grad_norm, num_zeros)``, ``get_loss_scale``, ``get_grad_norm``, state dicts) over
``torch.optim.AdamW`` with the same parameter groups (no weight decay on biases and 1-D
parameters) and the same tensor-parallel-aware global gradient norm.

Both paths use a constant learning rate ``optimizer.lr`` (the spec has no schedule).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.transformer_config import TransformerConfig

from tgapi import OptimizerSpec
from tgruntime.trainer.schedule import finalize_grads_local
from tgruntime.trainer.settings import RuntimeSettings

__all__ = [
    "LocalOptimizer",
    "OptimizerLike",
    "TrainingState",
    "apply_optimizer_spec",
    "build_training_state",
    "reset_optimizer_state",
    "step_overrides",
    "use_fused_adamw",
]


class OptimizerLike(Protocol):
    """The slice of megatron's ``MegatronOptimizer`` the engine relies on."""

    @property
    def param_groups(self) -> list[dict[str, Any]]: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def step(self) -> tuple[bool, float | None, int | None]: ...
    def get_loss_scale(self) -> torch.Tensor: ...
    def get_grad_norm(self) -> float: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    # megatron's standard override: biases and 1-D parameters (norm weights) get no decay.
    return param.dim() == 1 or name.endswith(".bias")


class LocalOptimizer:
    """AdamW with tensor-parallel-aware global-norm clipping, for CPU training."""

    def __init__(self, model: torch.nn.Module, spec: OptimizerSpec) -> None:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, param in model.named_parameters():
            if param.requires_grad:
                (no_decay if _no_weight_decay(name, param) else decay).append(param)
        self.clip_grad = spec.clip_grad
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": spec.weight_decay, "wd_mult": 1.0},
                {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0},
            ],
            lr=spec.lr,
            betas=(spec.adam_beta1, spec.adam_beta2),
            eps=1e-8,
        )
        self._scale = torch.ones(1)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient (all tensor/pipeline shards, no duplicates)."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        params = self._params()
        # the parameters' device: a LoRA run uses this optimizer on a GPU too (NCCL needs a
        # CUDA tensor, also on a pipeline stage without adapters)
        if params:
            device = params[0].device
        elif dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        for p in params:
            if (
                p.grad is not None
                and param_is_not_shared(p)
                and param_is_not_tensor_parallel_duplicate(p, tp_group)
            ):
                squares += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        return math.sqrt(float(squares.item()))

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        grad_norm = self.get_grad_norm()
        if not math.isfinite(grad_norm):
            return False, grad_norm, None
        if self.clip_grad > 0.0:
            coeff = self.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for p in self._params():
                    if p.grad is not None:
                        p.grad.mul_(coeff)
        self.optimizer.step()
        return True, grad_norm, None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


@dataclasses.dataclass(frozen=True)
class TrainingState:
    """What training updates: the (possibly DDP-wrapped) model and its optimizer."""

    model: torch.nn.Module  # DDP on GPU, the bare GPTModel on CPU
    module: torch.nn.Module  # the bare GPTModel
    optimizer: OptimizerLike

    def zero_grad(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply the accumulated gradient by ``factor`` (DDP buffers or ``.grad``)."""
        if isinstance(self.model, DistributedDataParallel):
            self.model.scale_gradients(factor)
            return
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def apply_optimizer_spec(optimizer: OptimizerLike, spec: OptimizerSpec) -> None:
    """Set every group's lr and weight decay from the spec and the group's multipliers.

    (megatron's LR scheduler normally applies ``wd_mult``/``lr_mult``; the trainer's rate is
    constant, so this runs once after building and again after loading a checkpoint, so the
    current spec wins over the saved values.)
    """
    for group in optimizer.param_groups:
        group["weight_decay"] = spec.weight_decay * group.get("wd_mult", 1.0)
        group["lr"] = spec.lr * group.get("lr_mult", 1.0)


def reset_optimizer_state(optimizer: OptimizerLike) -> None:
    """Forget Adam's moments and step counts (fresh optimizer state, same hyperparameters),
    and re-copy the model's weights into megatron's fp32 main params where it keeps them
    (after the model's weights were replaced, e.g. by a weights-only load)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            inner.state.clear()
        reload = getattr(part, "reload_model_params", None)
        if callable(reload):
            reload()


def use_fused_adamw(optimizer: Any) -> bool:
    """Switch megatron's ``torch.optim.AdamW`` fallback to torch's fused CUDA kernel.

    Without Transformer Engine or apex, megatron builds ``torch.optim.AdamW`` with default
    (foreach) arithmetic, which allocates full-size temporaries (e.g. ``sqrt(v)``: 4 bytes
    per parameter) and launches several kernels per tensor list. The fused kernel is one
    pass and no temporaries; it reads the per-group flag at step time, so setting it before
    the first step is enough. ``TG_FUSED_ADAM=0`` keeps megatron's default. Returns whether
    it switched.
    """
    if os.environ.get("TG_FUSED_ADAM", "1") == "0":
        return False
    switched = False
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and not inner.state:
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
            switched = True
    return switched


def build_training_state(
    module: torch.nn.Module,
    *,
    config: TransformerConfig,
    spec: OptimizerSpec,
    settings: RuntimeSettings,
) -> TrainingState:
    """Wrap ``module`` and build its optimizer; wires megatron's schedule hooks into ``config``."""
    if not settings.on_gpu:
        local = LocalOptimizer(module, spec)
        config.finalize_model_grads_func = finalize_grads_local
        return TrainingState(model=module, module=module, optimizer=local)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=spec.lr,
        min_lr=spec.min_lr,
        weight_decay=spec.weight_decay,
        adam_beta1=spec.adam_beta1,
        adam_beta2=spec.adam_beta2,
        adam_eps=1e-8,
        clip_grad=spec.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    apply_optimizer_spec(optimizer, spec)
    use_fused_adamw(optimizer)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return TrainingState(model=model, module=module, optimizer=optimizer)


def _configs(optimizer: Any) -> list[Any]:
    """megatron's OptimizerConfig objects (one per chained optimizer); none on CPU."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p.config for p in parts if getattr(p, "config", None) is not None]


@contextlib.contextmanager
def step_overrides(
    optimizer: OptimizerLike,
    *,
    lr: float | None = None,
    clip_grad: float | None = None,
    weight_decay: float | None = None,
    betas: tuple[float, float] | None = None,
    eps: float | None = None,
) -> Iterator[None]:
    """Apply per-step overrides (lr, clip_grad, weight_decay, betas, eps) and restore them.

    ``lr`` and ``weight_decay`` are scaled by each group's ``lr_mult``/``wd_mult`` as the
    spec's values are; ``clip_grad`` 0 turns clipping off for the step; ``betas`` and ``eps``
    are Adam's (every group; torch's AdamW reads them at step time, fused kernel included).
    """
    for name, value in (
        ("lr", lr),
        ("grad_clip", clip_grad),
        ("weight_decay", weight_decay),
        ("eps", eps),
    ):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ValueError(f"optim_step({name}={value!r}): must be a finite number >= 0")
    if betas is not None:
        pair = tuple(float(b) for b in betas)
        if len(pair) != 2 or not all(0.0 <= b < 1.0 for b in pair):
            raise ValueError(f"optim_step(betas={betas!r}): must be two numbers in [0, 1)")
        betas = (pair[0], pair[1])
    groups = optimizer.param_groups
    saved = [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in groups]
    configs = _configs(optimizer)
    saved_clip = [c.clip_grad for c in configs]
    local_clip = getattr(optimizer, "clip_grad", None)
    try:
        for g in groups:
            if lr is not None:
                g["lr"] = lr * g.get("lr_mult", 1.0)
            if weight_decay is not None:
                g["weight_decay"] = weight_decay * g.get("wd_mult", 1.0)
            if betas is not None:
                g["betas"] = betas
            if eps is not None:
                g["eps"] = eps
        if clip_grad is not None:
            for c in configs:
                c.clip_grad = clip_grad
            if local_clip is not None:
                optimizer.clip_grad = clip_grad  # type: ignore[attr-defined]
        yield
    finally:
        for g, (old_lr, old_wd, old_betas, old_eps) in zip(groups, saved, strict=True):
            g["lr"], g["weight_decay"], g["betas"], g["eps"] = old_lr, old_wd, old_betas, old_eps
        for c, old in zip(configs, saved_clip, strict=True):
            c.clip_grad = old
        if local_clip is not None:
            optimizer.clip_grad = local_clip  # type: ignore[attr-defined]
