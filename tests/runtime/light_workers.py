"""Worker classes without torch, so their actors start fast (used where no DataProto moves)."""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from tgruntime.controller.decorator import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from tgruntime.controller.worker import Worker


class Counter(Worker):
    """A tiny stateful worker."""

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.value = start

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        self.value += x
        return self.value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": os.getpid(),
            "name": os.environ.get("TG_WORKER_NAME"),
            "master": (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")),
            "node_id": ray.get_runtime_context().get_node_id(),
            "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        }

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def scaled(self, x: int) -> int:
        return x * (self.rank + 1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> str:
        if self.rank == rank:
            raise ValueError(f"boom on rank {self.rank}")
        return "ok"

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def leader(self, x: int) -> tuple[int, int]:
        return (self.rank, x)


class Broken(Worker):
    """Its constructor raises: group creation must fail clearly and clean up."""

    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError("constructor exploded on purpose")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None


@ray.remote
class VerlStyle(Worker):
    """A verl-style worker: decorated with @ray.remote, as verl's examples do."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info(mesh_name="train", dp_rank=self.rank, is_collect=True)
        self.model: dict[str, int] | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> str:
        self.model = {"steps": 0}
        return "ready"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def steps(self) -> int:
        assert self.model is not None
        return self.model["steps"]

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
    def train_model(self, data: Any) -> Any:
        from tgruntime.controller.dataproto import DataProto

        assert self.model is not None
        self.model["steps"] += 1
        loss = data.batch["input_ids"].float().mean(dim=-1)
        return DataProto.from_dict(tensors={"loss": loss})


class MeshProbe(Counter):
    """A mesh "train" given per rank (``dp_ranks[rank]``; the first rank of each dp rank
    collects): ``step`` returns its shard tagged with the rank that computed it, and
    ``seen`` what each rank received (tp peers must have got the same rows). torch is
    imported only when a DataProto arrives. A Counter too, so one group serves the placement
    checks (``whoami``, ``scaled``) and the mesh dispatch."""

    def __init__(self, dp_ranks: list[int]) -> None:
        super().__init__()
        dp = dp_ranks[self.rank]
        self._register_dispatch_collect_info(
            mesh_name="train", dp_rank=dp, is_collect=dp_ranks.index(dp) == self.rank
        )
        self._seen: list[int] = []

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"))
    def step(self, data: Any) -> Any:
        import torch

        from tgruntime.controller.dataproto import DataProto

        x = data.batch["x"]
        self._seen = [int(v) for v in x.tolist()]
        return DataProto.from_dict(tensors={"x": x, "rank": torch.full_like(x, self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def seen(self) -> list[int]:
        return self._seen


class SpecEcho(Worker):
    """Built from a TrainerGroup spec like the Megatron trainer, but without torch: its
    ``init_model`` reports the device the way the trainer does ("cuda:N" when Ray gave the
    actor a GPU, else "cpu"), plus the ``useGpu`` value the workers received."""

    def __init__(self, spec_json: str) -> None:
        super().__init__()
        import json

        self.spec = json.loads(spec_json)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        gpus = ray.get_gpu_ids()
        on_gpu = bool(gpus)
        return {
            "rank": self.rank,
            "device": f"cuda:{gpus[0]}" if on_gpu else "cpu",
            "backend": "nccl" if on_gpu else "gloo",
            "dtype": "bfloat16" if on_gpu else "float32",
            "use_gpu": self.spec["workers"]["useGpu"],
        }


class Holder:
    """A plain actor class (not a Worker): holds a name, for races against teardown."""

    def ping(self) -> str:
        return "here"
