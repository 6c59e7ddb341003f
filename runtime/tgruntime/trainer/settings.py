"""Where and how a trainer process runs: device, dtype, backend, position embedding.

One resolved, frozen value decides every CPU/GPU fork in the trainer, so the rest of the
code reads ``settings.on_gpu`` instead of probing CUDA again:

* GPU (``workers.useGpu`` true, or "auto" with CUDA present): NCCL, the spec's dtype (bf16 by
  default), RoPE for ``position_embedding: auto``, megatron's pipeline schedules, DDP and optimizer.
* CPU: gloo, float32 whatever the spec's dtype, learned absolute positions for ``auto``
  (``rope`` still works through the device-local rotary module), and the trainer's own
  CPU schedule and optimizer (megatron's allocate CUDA tensors unconditionally).

GPU or fail: ``useGpu: true`` on a rank that sees no CUDA device raises
:class:`~tgruntime.trainer.gpu_check.NoCudaDeviceError` (the driver seen, the one the image's
torch needs, the fix) instead of falling back to the CPU; only an unresolved "auto" falls back.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from tgapi import TrainerGroupSpec
from tgruntime.trainer.gpu_check import CPU_FALLBACK_ENV, cpu_fallback_allowed, no_cuda_error

__all__ = ["RuntimeSettings", "resolve_settings"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    device: str  # "cuda" or "cpu"
    dtype: torch.dtype
    backend: str  # torch.distributed backend: "nccl" or "gloo"
    position_embedding: str  # "rope" or "learned_absolute"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_settings(
    spec: TrainerGroupSpec, *, backend: str | None = None, device: str | None = None
) -> RuntimeSettings:
    """Resolve the spec against this machine.

    ``device`` forces ``"cuda"``/``"cpu"``. By default ``useGpu: true`` means the GPU, and a
    rank that sees no CUDA device raises ``NoCudaDeviceError`` (never a silent CPU run);
    ``useGpu: false`` means the CPU with gloo; "auto" (when a group's server did not resolve
    it) means the GPU when CUDA is available, else the CPU. The group's ready line and record
    report the result (``device``/``backend``). ``backend`` overrides the torch.distributed
    backend.
    """
    if device is None:
        use_gpu = spec.workers.use_gpu
        if use_gpu is True:
            device = "cuda"
        else:  # False, or "auto"
            device = "cuda" if use_gpu is not False and torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        if not cpu_fallback_allowed():
            rank = os.environ.get("RANK", "")
            raise no_cuda_error(rank=int(rank) if rank.isdigit() else None)
        import logging

        logging.getLogger(__name__).warning(
            "useGpu asks for a GPU and torch sees none; %s=1 (the runtime image's CPU variant) "
            "lets this rank run on the CPU with gloo",
            CPU_FALLBACK_ENV,
        )
        device = "cpu"
    on_gpu = device == "cuda"
    dtype = _DTYPES[spec.model.dtype] if on_gpu else torch.float32
    position = spec.model.position_embedding
    if position == "auto":
        position = "rope" if on_gpu else "learned_absolute"
    return RuntimeSettings(
        device=device,
        dtype=dtype,
        backend=backend or ("nccl" if on_gpu else "gloo"),
        position_embedding=position,
    )
