"""torch.distributed and megatron model-parallel set-up for one trainer process, and its mesh.

The process group is initialised from the usual environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), which torchrun, the benchmark's spawner
and the controller layer's ``Worker`` all set. :class:`Mesh` is this rank's place in the
tensor x pipeline x context x data grid, and whether its outputs are the ones collected
(first tensor-parallel rank of the last pipeline stage).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tgruntime.trainer.settings import RuntimeSettings

__all__ = [
    "Mesh",
    "current_mesh",
    "destroy_parallel",
    "init_model_parallel",
    "init_process_group",
    "select_device",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mesh:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int

    @property
    def is_collect(self) -> bool:
        """Whether this rank's outputs stand for its data-parallel group."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["is_collect"] = self.is_collect
        return out


def select_device(settings: RuntimeSettings) -> torch.device:
    """Bind this process to its GPU (``LOCAL_RANK`` modulo the visible devices) or the CPU."""
    if not settings.on_gpu:
        return torch.device("cpu")
    index = _ray_assigned_gpu()
    if index is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _ray_assigned_gpu() -> int | None:
    """The GPU Ray assigned to this actor, when the actor sees all of the node's GPUs.

    TrainerGroups start GPU workers with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 so
    that every worker sees every GPU of its node: NCCL then uses direct peer-to-peer
    (NVLink) between the ranks, which it cannot when each process sees only its own GPU.
    Each worker must then pick the GPU Ray gave it (not LOCAL_RANK, which would collide
    when two groups share a node).
    """
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") != "1":
        return None
    try:
        import ray

        if not ray.is_initialized():
            return None
        ids = ray.get_gpu_ids()
    except Exception:
        return None
    if not ids:
        return None
    physical = int(ids[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        order = [v.strip() for v in visible.split(",")]
        return order.index(str(physical)) if str(physical) in order else None
    return physical


def init_process_group(
    settings: RuntimeSettings, *, timeout: datetime.timedelta | None = None
) -> bool:
    """Initialise the default process group from the environment.

    Returns True when this call created it, False when it already existed (then the
    caller does not own it and must not destroy it).
    """
    if dist.is_initialized():
        return False
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"torch.distributed needs {', '.join(missing)} in the environment "
            "(set by torchrun, the benchmark spawner or the worker group)"
        )
    kwargs: dict[str, Any] = {}
    if settings.on_gpu:
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend=settings.backend,
        init_method="env://",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout or datetime.timedelta(minutes=10),
        **kwargs,
    )
    return True


def init_model_parallel(*, tp: int, pp: int, cp: int) -> None:
    """Create megatron's tensor/pipeline/context/data-parallel groups."""
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"tensor x pipeline x context = {tp} x {pp} x {cp} does not divide the world size "
            f"{world}"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
    )


def current_mesh() -> Mesh:
    return Mesh(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )


def destroy_parallel(*, destroy_process_group: bool) -> None:
    """Tear down megatron's groups and, when asked (we created it), the default group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
