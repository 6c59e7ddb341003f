"""Worker classes used by the runtime tests (importable by the Ray worker processes)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from tensordict import TensorDict

from tgruntime.controller import (
    DataProto,
    Dispatch,
    Execute,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from tgruntime.controller.dataproto import DataProtoItem


def batch_of(data: DataProto | DataProtoItem) -> TensorDict:
    """``data.batch``, which these tests always fill (DataProto types it as optional)."""
    assert data.batch is not None
    return data.batch


def split_by_rank(group: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """A custom dispatch: every rank gets (its rank, the argument)."""
    n = group.world_size
    return tuple([(r, a) for r in range(n)] for a in args), {
        k: [(r, v) for r in range(n)] for k, v in kwargs.items()
    }


def sum_collect(group: Any, outputs: list[Any]) -> Any:
    """A custom collect: the sum of the outputs."""
    return sum(outputs)


class Echo(Worker):
    """Small worker exercising every dispatch mode."""

    def __init__(self, scale: int = 1, tp: int = 1) -> None:
        super().__init__()
        self.scale = scale
        self.tp = tp
        self.counter = 0
        # Mesh "train": ranks in groups of tp share a dp rank; the first of each is collected.
        self._register_dispatch_collect_info(
            mesh_name="train", dp_rank=self.rank // tp, is_collect=(self.rank % tp == 0)
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "master": (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")),
            "pid": os.getpid(),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        self.counter += x
        return self.counter * self.scale + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def all_to_all(self, x: Any) -> Any:
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def dp_square(self, x: int) -> int:
        return x * x

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        out = DataProto.from_dict(
            tensors={"y": batch_of(data)["x"] * 2, "rank": torch.full((len(data),), self.rank)},
            non_tensors={"tag": data.non_tensor_batch["tag"]}
            if "tag" in data.non_tensor_batch
            else None,
        )
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_async(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"x": batch_of(data)["x"] * 2})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def chunk_len(self, data: DataProto) -> int:
        return len(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
    def nd_step(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            tensors={
                "y": batch_of(data)["x"] + 1000 * (self.rank // self.tp),
                "rank": torch.full((len(data),), self.rank),
            }
        )

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rank_zero_only(self, x: int) -> tuple[int, int]:
        return (self.rank, x)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def exec_rank_zero(self, x: int) -> tuple[int, int]:
        return (self.rank, x)

    @register(dispatch_mode={"dispatch_fn": split_by_rank, "collect_fn": sum_collect})
    def custom(self, pair: tuple[int, int]) -> int:
        rank, value = pair
        assert rank == self.rank
        return value * (rank + 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def add_async(self, x: int) -> int:
        return x + self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail(self, rank: int) -> str:
        if self.rank == rank:
            raise ValueError(f"boom on rank {self.rank}")
        return "ok"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data: DataProto) -> DataProto:
        return DataProto(batch=TensorDict({"z": batch_of(data)["x"] + 1}, batch_size=[len(data)]))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total(self, data: DataProto) -> float:
        return float(batch_of(data)["x"].sum())

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def take(self, value: int) -> int:
        return value * 10

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def allreduce(self) -> list[float]:
        """torch.distributed (gloo) across the group, initialised from the Worker's env."""
        self.init_torch_distributed(backend="gloo", timeout_s=60)
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.tolist()
