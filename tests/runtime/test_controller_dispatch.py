"""Dispatch/collect logic, register, naming, records and errors, without Ray."""

from __future__ import annotations

import inspect
import json
import pickle
from typing import Any

import pytest
import torch

from tgruntime.controller import (
    DataProto,
    Dispatch,
    Execute,
    GroupNotFoundError,
    MethodSpec,
    PlacementTimeoutError,
    ResourcePool,
    Worker,
    WorkerDiedError,
    WorkerMethodError,
    make_nd_compute_dataproto_dispatch_fn,
    naming,
    register,
    registered_methods,
)
from tgruntime.controller import dispatch as d
from tgruntime.controller.decorator import TRIM_KWARG, CustomDispatch, MeshDispatch, _trim
from tgruntime.controller.registry import GroupRecord


class FakeGroup:
    def __init__(
        self, n: int, mapping: list[int] | None = None, collect: list[bool] | None = None
    ) -> None:
        self._n = n
        self.mapping = mapping or list(range(n))
        self.collect = collect or [True] * n

    @property
    def world_size(self) -> int:
        return self._n

    def mesh_dispatch_info(self, mesh_name: str) -> list[int]:
        return self.mapping

    def mesh_collect_info(self, mesh_name: str) -> list[bool]:
        return self.collect


def proto(n: int) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(n)}, non_tensors={"i": list(range(n))})


def test_one_to_all_and_all_to_all() -> None:
    g = FakeGroup(3)
    args, kwargs = d.dispatch_one_to_all(g, 5, k="v")
    assert args == ([5, 5, 5],) and kwargs == {"k": ["v", "v", "v"]}
    # verl's rule: lists of world size are scattered, anything else broadcast
    assert d.dispatch_all_to_all(g, [1, 2, 3])[0] == ([1, 2, 3],)
    assert d.dispatch_all_to_all(g, [1, 2])[0] == ([[1, 2]] * 3,)
    assert d.dispatch_all_to_all(g, [1, 2, 3], 7)[0] == ([[1, 2, 3]] * 3, [7, 7, 7])


def test_dp_compute_requires_one_value_per_rank() -> None:
    g = FakeGroup(2)
    assert d.dispatch_dp_compute(g, [1, 2], y=(3, 4)) == (([1, 2],), {"y": [3, 4]})
    with pytest.raises(ValueError, match="list of 2 values"):
        d.dispatch_dp_compute(g, [1, 2, 3])
    with pytest.raises(ValueError, match="expected 2 outputs"):
        d.collect_dp_compute(g, [1])


@pytest.mark.parametrize("n,ranks", [(8, 4), (10, 4), (5, 4), (1, 3), (3, 3)])
def test_dp_proto_dispatch_pads_and_workers_trim(n: int, ranks: int) -> None:
    g = FakeGroup(ranks)
    args, kwargs = d.dispatch_dp_compute_data_proto(g, proto(n), "broadcast")
    parts, extra = args
    assert extra == ["broadcast"] * ranks
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1  # every rank gets the same number of rows
    trims = kwargs.get(TRIM_KWARG, [None] * ranks)
    # emulate each worker: identity method, trimmed by the register wrapper
    outs = [_trim(p, t) for p, t in zip(parts, trims, strict=True)]
    joined = d.collect_dp_compute_data_proto(g, outs)
    assert joined.batch["x"].tolist() == list(range(n))
    assert list(joined.non_tensor_batch["i"]) == list(range(n))
    if n % ranks == 0:
        assert TRIM_KWARG not in kwargs


def test_dp_proto_args_must_share_length() -> None:
    with pytest.raises(ValueError, match="same length"):
        d.dispatch_dp_compute_data_proto(FakeGroup(2), proto(4), proto(6))


def test_dp_proto_collect_rejects_non_dataproto() -> None:
    with pytest.raises(TypeError, match="DataProto"):
        d.collect_dp_compute_data_proto(FakeGroup(2), [proto(1), {"a": 1}])


def test_with_func_broadcasts_the_function() -> None:
    def f(x: Any) -> Any:
        return x

    args, _ = d.dispatch_dp_compute_data_proto_with_func(FakeGroup(2), f, proto(4))
    assert args[0] == [f, f] and [len(p) for p in args[1]] == [2, 2]


def test_nd_mesh_dispatch_and_collect() -> None:
    # tp=2, dp=2: ranks 0,1 -> dp 0; ranks 2,3 -> dp 1; ranks 0 and 2 are collected
    g = FakeGroup(4, mapping=[0, 0, 1, 1], collect=[True, False, True, False])
    args, kwargs = d.dispatch_nd_proto("train", g, proto(5))
    parts = args[0]
    assert parts[0] is parts[1] and parts[2] is parts[3]  # one object per dp slice
    assert len(parts[0]) == 3 and len(parts[2]) == 3  # 5 rows -> 3 + 2 padded to 3
    trims = kwargs[TRIM_KWARG]
    outs = [_trim(p, t) for p, t in zip(parts, trims, strict=True)]
    joined = d.collect_nd_proto("train", g, outs)
    assert joined.batch["x"].tolist() == [0, 1, 2, 3, 4]


def test_nd_collect_orders_by_dp_rank_and_checks_marks() -> None:
    g = FakeGroup(2, mapping=[1, 0], collect=[True, True])
    outs = [
        proto(2),
        DataProto.from_dict(tensors={"x": torch.tensor([7, 8])}, non_tensors={"i": [0, 1]}),
    ]
    assert d.collect_nd_proto("m", g, outs).batch["x"].tolist() == [7, 8, 0, 1]
    bad = FakeGroup(2, mapping=[0, 0], collect=[True, True])
    with pytest.raises(ValueError, match="exactly one rank per dp rank"):
        d.collect_nd_proto("m", bad, [proto(1), proto(1)])
    with pytest.raises(ValueError, match="no rank registered dp ranks"):
        d.dispatch_nd_proto("m", FakeGroup(2, mapping=[0, 2]), proto(2))


def test_register_records_spec_and_keeps_method_callable() -> None:
    class W(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def step(self, data: DataProto) -> DataProto:
            return data

        @register(
            dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="train"),
            execute_mode=Execute.ALL,
        )
        def train(self, data: DataProto) -> DataProto:
            return data

        @register()
        def plain(self, x: int) -> int:
            return x + 1

    specs = registered_methods(W)
    assert specs["step"].dispatch_mode is Dispatch.DP_COMPUTE_PROTO and not specs["step"].blocking
    assert isinstance(specs["train"].dispatch_mode, MeshDispatch)
    assert specs["plain"].dispatch_mode is Dispatch.ALL_TO_ALL  # verl's default
    assert {
        "_query_dispatch_info",
        "_query_collect_info",
        "_tg_mesh_info",
        "_tg_worker_info",
    } <= set(specs)
    w = W()
    assert w.plain(1) == 2
    # the controller's trim keyword is accepted (Ray validates calls against this signature)
    assert TRIM_KWARG in inspect.signature(W.step).parameters
    assert len(w.step(proto(4), **{TRIM_KWARG: (3, 4)})) == 3


def test_method_spec_description_round_trip() -> None:
    for spec in (
        MethodSpec(dispatch_mode=Dispatch.ONE_TO_ALL),
        MethodSpec(
            dispatch_mode=MeshDispatch("train"), execute_mode=Execute.RANK_ZERO, blocking=False
        ),
        MethodSpec(
            dispatch_mode=CustomDispatch(
                dispatch_fn=d.dispatch_one_to_all, collect_fn=d.collect_all_to_all
            )
        ),
    ):
        back = MethodSpec.from_description(spec.describe())
        assert back.describe() == spec.describe()
    lazy = MethodSpec.from_description(
        MethodSpec(
            dispatch_mode=CustomDispatch(
                dispatch_fn=d.dispatch_one_to_all, collect_fn=d.collect_all_to_all
            )
        ).describe()
    )
    assert isinstance(lazy.dispatch_mode, CustomDispatch)
    assert lazy.dispatch_mode.dispatch_fn(FakeGroup(2), 1) == (([1, 1],), {})


def test_custom_dispatch_dict_is_validated() -> None:
    with pytest.raises(ValueError, match="collect_fn"):
        register(dispatch_mode={"dispatch_fn": d.dispatch_one_to_all})
    with pytest.raises(TypeError):
        register(dispatch_mode="ONE_TO_ALL")


def test_worker_mesh_registration() -> None:
    w = Worker()
    w._register_dispatch_collect_info("train", dp_rank=1, is_collect=False)
    w._register_dispatch_collect_info("train", dp_rank=1, is_collect=False)  # same again: fine
    assert w._query_dispatch_info("train") == 1 and w._query_collect_info("train") is False
    assert w._tg_mesh_info() == {"train": (1, False)}
    with pytest.raises(ValueError, match="already registered"):
        w._register_dispatch_collect_info("train", dp_rank=0, is_collect=True)
    with pytest.raises(KeyError, match="_register_dispatch_collect_info"):
        w._query_dispatch_info("other")


def test_naming() -> None:
    assert (
        naming.worker_name(prefix="trainer", class_name="Trainer", pg_index=0, local_rank=1)
        == "trainerTrainer_0:1"
    )
    assert naming.parse_worker_name("trainerTrainer_0:1") == ("trainerTrainer", 0, 1)
    assert (
        naming.placement_group_name(ray_namespace="ns", group_name="g", generation=2, index=1)
        == "tg:ns:g:g2:1"
    )
    assert naming.placement_group_name(
        ray_namespace="ns", group_name="g", generation=0, index=0
    ).startswith(naming.placement_group_prefix(ray_namespace="ns", group_name="g"))
    assert not naming.placement_group_name(
        ray_namespace="ns", group_name="g2", generation=0, index=0
    ).startswith(naming.placement_group_prefix(ray_namespace="ns", group_name="g"))
    for bad in ("", "a:b", "a/b", "-x", "x" * 200):
        with pytest.raises(ValueError):
            naming.validate_group_name(bad)
    with pytest.raises(ValueError):
        naming.validate_namespace("")


def test_group_record_json_round_trip() -> None:
    record = GroupRecord(
        group_name="g",
        ray_namespace="ns",
        worker_names=("gW_0:0", "gW_0:1"),
        world_size=2,
        mesh={"tp": 2},
        worker_class="m:W",
        generation=1,
        created_at=1.5,
        methods={"f": MethodSpec(dispatch_mode=Dispatch.ONE_TO_ALL).describe()},
        placement_groups=("tg:ns:g:g1:0",),
    )
    assert GroupRecord.from_json(record.to_json()) == record
    legacy = json.loads(record.to_json())
    legacy["namespace"] = legacy.pop("ray_namespace")  # a record published before the rename
    assert GroupRecord.from_json(json.dumps(legacy)) == record


def test_errors_name_group_rank_cause_and_pickle() -> None:
    errors = [
        WorkerDiedError(
            group_name="g", rank=1, worker_name="gW_0:1", cause="SIGKILL", method="train"
        ),
        WorkerMethodError(
            group_name="g",
            rank=0,
            worker_name="gW_0:0",
            method="train",
            error_type="ValueError",
            summary="bad",
        ),
        GroupNotFoundError(group_name="g", ray_namespace="ns", existing=["h"]),
        PlacementTimeoutError(
            group_name="g",
            timeout_s=3,
            bundles=[[{"CPU": 4.0}] * 2],
            strategy="STRICT_PACK",
            available={"CPU": 2.0},
            total={"CPU": 2.0, "node:1.2.3.4": 1.0},
        ),
    ]
    texts = [str(e) for e in errors]
    assert "rank 1" in texts[0] and "gW_0:1" in texts[0] and "SIGKILL" in texts[0]
    assert "ValueError" in texts[1] and "train()" in texts[1]
    assert "'ns'" in texts[2] and "h" in texts[2]
    assert "CPU=8" in texts[3] and "CPU=2" in texts[3] and "node:" not in texts[3]
    for e in errors:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)


def test_resource_pool_bundles() -> None:
    pool = ResourcePool(process_on_nodes=[2, 1], cpus_per_process=0.25)
    assert pool.world_size == 3 and pool.bundles() == [[{"CPU": 0.25}] * 2, [{"CPU": 0.25}]]
    assert pool.actor_options() == {"num_cpus": 0.25, "num_gpus": 0.0}
    gpu = ResourcePool(process_on_nodes=[4], use_gpu=True, gpus_per_process=0.5, strategy="PACK")
    assert gpu.bundle() == {"CPU": 1.0, "GPU": 0.5} and gpu.strategy == "PACK"
    with pytest.raises(ValueError):
        ResourcePool(process_on_nodes=[])
    with pytest.raises(ValueError):
        ResourcePool(process_on_nodes=[1], strategy="NOPE")
