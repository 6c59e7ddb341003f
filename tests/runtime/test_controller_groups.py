"""Groups on a real local Ray: every dispatch mode, chaining between groups, errors.

Two groups of the ``Echo`` worker live for the whole module (created concurrently):
``a`` (2 ranks, mesh "train" with tp=1: dp=2) and ``b`` (2 ranks, tp=2: dp=1).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import ray
import torch

from tests.runtime.workers import Echo, batch_of
from tgruntime.controller import (
    CallTimeoutError,
    ClassWithInitArgs,
    DataProto,
    DataProtoFuture,
    ResourcePool,
    WorkerGroup,
    WorkerMethodError,
)

pytestmark = pytest.mark.ray


@dataclass(frozen=True)
class Groups:
    a: WorkerGroup
    b: WorkerGroup
    ray_namespace: str


@pytest.fixture(scope="module")
def groups(ray_driver: object) -> Iterator[Groups]:
    ray_namespace = "t-groups"
    pool = ResourcePool(process_on_nodes=[2], cpus_per_process=0.2)

    def make(name: str, tp: int) -> WorkerGroup:
        return WorkerGroup.create(
            group_name=name, ray_namespace=ray_namespace, resource_pool=pool,
            cls=ClassWithInitArgs(Echo, scale=2, tp=tp), actor_timeout_s=240, pg_timeout_s=60,
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool_exec:
        fa, fb = pool_exec.submit(make, "a", 1), pool_exec.submit(make, "b", 2)
        a, b = fa.result(), fb.result()
    try:
        yield Groups(a=a, b=b, ray_namespace=ray_namespace)
    finally:
        a.teardown()
        b.teardown()


def batch(n: int, *, tags: bool = True) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n)},
        non_tensors={"tag": [f"t{i}" for i in range(n)]} if tags else None,
        meta_info={"note": "m"},
    )


def test_worker_env_and_master_port(groups: Groups) -> None:
    infos = groups.a.info()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert [i["local_rank"] for i in infos] == [0, 1] and {
        i["local_world_size"] for i in infos
    } == {2}
    masters = {i["master"] for i in infos}
    assert len(masters) == 1 and None not in next(iter(masters))
    assert groups.a.worker_names == ["aEcho_0:0", "aEcho_0:1"]
    # torch.distributed initialises from that environment (gloo), across both ranks
    assert groups.a.allreduce() == [[3.0], [3.0]]


def test_one_to_all_all_to_all_dp_compute(groups: Groups) -> None:
    first = groups.a.add(1)
    second = groups.a.add(1)
    assert [s - f for f, s in zip(first, second, strict=True)] == [2, 2]  # state kept, scale 2
    assert groups.a.all_to_all([10, 20]) == [(0, 10), (1, 20)]  # scattered
    assert groups.a.all_to_all("x") == [(0, "x"), (1, "x")]  # broadcast
    assert groups.a.dp_square([3, 4]) == [9, 16]


@pytest.mark.parametrize("n", [6, 5, 1])
def test_dp_compute_proto_even_and_uneven(groups: Groups, n: int) -> None:
    out = groups.a.double(batch(n))
    assert out.batch["y"].tolist() == [2 * i for i in range(n)]
    assert list(out.non_tensor_batch["tag"]) == [f"t{i}" for i in range(n)]
    ranks = out.batch["rank"].tolist()
    assert ranks == sorted(ranks)  # rank 0's rows first
    # every rank saw the same (padded) number of rows
    sizes = groups.a.chunk_len(batch(n))
    assert len(set(sizes)) == 1 and sizes[0] == -(-n // 2)


def test_dataproto_round_trip_keeps_dtypes(groups: Groups) -> None:
    data = DataProto.from_dict(
        tensors={
            "x": torch.arange(8),
            "h": torch.randn(8, 16).to(torch.bfloat16),
            "mask": torch.rand(8, 3) > 0.5,
        },
        non_tensors={"obj": np.array([{"i": i} for i in range(8)], dtype=object)},
    )
    back = groups.a.echo(data)
    for key in ("x", "h", "mask"):
        assert batch_of(back)[key].dtype == batch_of(data)[key].dtype
        assert torch.equal(batch_of(back)[key], batch_of(data)[key])
    assert [o["i"] for o in back.non_tensor_batch["obj"]] == list(range(8))


def test_nd_mesh_dispatch(groups: Groups) -> None:
    # a: tp=1 -> dp=2: rows split, each rank collected
    out = groups.a.nd_step(batch(5, tags=False))
    assert out.batch["y"].tolist() == [0, 1, 2, 1003, 1004]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    # b: tp=2 -> dp=1: both ranks get the whole batch; only rank 0's output is collected
    out_b = groups.b.nd_step(batch(5, tags=False))
    assert out_b.batch["y"].tolist() == [0, 1, 2, 3, 4] and out_b.batch["rank"].tolist() == [0] * 5
    assert groups.b.mesh_dispatch_info("train") == [0, 0] and groups.b.mesh_collect_info(
        "train"
    ) == [True, False]


def test_rank_zero_custom_and_execute_modes(groups: Groups) -> None:
    assert groups.a.rank_zero_only(5) == (0, 5)
    assert groups.a.exec_rank_zero(6) == (0, 6)
    assert groups.a.custom(3) == 3 * 1 + 3 * 2  # custom dispatch (rank, value) + custom sum collect
    assert groups.a.call("custom", 1) == 3


def test_non_blocking_chaining_between_groups(groups: Groups) -> None:
    data = batch(5, tags=False)
    future = groups.a.double_async(data)
    assert isinstance(future, DataProtoFuture) and future.num_parts == 2
    # the future's parts go straight to b's ranks (2 parts for 2 ranks)
    assert groups.b.consume(future).batch["z"].tolist() == [2 * i + 1 for i in range(5)]
    # ONE_TO_ALL: each b rank materialises the whole future itself
    assert groups.b.total(future) == [20.0, 20.0]
    # plain ObjectRefs from a non-blocking call are resolved on the receiving workers
    refs = groups.a.add_async(1)
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    assert groups.b.take(refs) == [10, 20]
    # a future whose parts do not match the world size is fetched and re-split
    single = DataProtoFuture.concat([ray.put(batch(3, tags=False))])
    assert groups.b.consume(single).batch["z"].tolist() == [1, 2, 3]
    assert batch_of(future.get())["x"].tolist() == [2 * i for i in range(5)]


def test_worker_exception_names_rank_method_and_traceback(groups: Groups) -> None:
    with pytest.raises(WorkerMethodError) as info:
        groups.a.fail(1)
    err = info.value
    assert err.rank == 1 and err.method == "fail" and err.error_type == "ValueError"
    assert err.worker_name == "aEcho_0:1" and err.group_name == "a"
    assert "boom on rank 1" in str(err) and "boom on rank 1" in err.remote_traceback


def test_call_timeout(groups: Groups) -> None:
    groups.b.call_timeout_s = 1.0
    try:
        with pytest.raises(CallTimeoutError, match="rank 0"):
            groups.b.sleep(4)
    finally:
        groups.b.call_timeout_s = None
    assert groups.b.sleep(0) == [0, 0]  # waits behind the sleeping call, then answers


def test_attach_paths_share_the_workers(groups: Groups) -> None:
    by_name = WorkerGroup.attach(group_name="a", ray_namespace=groups.ray_namespace)
    assert by_name.worker_names == groups.a.worker_names and by_name.record is not None
    assert by_name.ray_namespace == groups.ray_namespace
    # ``namespace=``, the old name of ``ray_namespace``, is gone (issue 21): a TypeError, and
    # the group has no ``namespace`` attribute any more.
    with pytest.raises(TypeError, match="unexpected keyword argument 'namespace'"):
        WorkerGroup.attach(group_name="a", namespace=groups.ray_namespace)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        by_name.namespace  # noqa: B018
    with pytest.raises(TypeError, match="'ray_namespace'"):
        WorkerGroup.attach(group_name="a")  # type: ignore[call-arg]  # on purpose
    assert by_name.record.world_size == 2 and by_name.record.worker_class.endswith(":Echo")
    assert set(by_name.record.methods) >= {"double", "nd_step", "custom"}
    by_names = WorkerGroup.from_worker_names(
        worker_names=groups.a.worker_names, ray_namespace=groups.ray_namespace
    )
    by_handles = WorkerGroup.from_handles(
        handles=groups.a.workers, worker_cls=Echo, ray_namespace=groups.ray_namespace
    )
    assert (
        by_name.all_to_all([1, 2]) == by_names.all_to_all([1, 2]) == by_handles.all_to_all([1, 2])
    )
    # custom dispatch functions travel by import path in the record
    assert by_name.custom(1) == 3
    health = by_name.health()
    assert [h.state for h in health] == ["ALIVE", "ALIVE"] and all(h.pid > 0 for h in health)
