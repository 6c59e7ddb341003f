"""verl's detached-worker example, ported by changing imports only, on the session's small Ray.

The server and the client are separate OS processes; the client uses plain
``ray.init(namespace=...)`` and verl's ``RayWorkerGroup.from_detached`` as verl users do.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group_table

from tests.fixtures_ray import RayCluster
from tgruntime.compat.verl.single_controller.ray.base import RayResourcePool, _bundle_cpus
from tgruntime.controller import WorkerGroup, naming, teardown_group

pytestmark = pytest.mark.ray


def test_verl_detached_server_and_client_round_trip(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    ns = unique_namespace
    server = ray_driver.run_python(f"""
        import json, ray
        from tgruntime.compat.verl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from tests.runtime.light_workers import VerlStyle   # a @ray.remote class, as in verl

        ray.init(namespace={ns!r})
        resource_pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, detached=True)
        cls_with_init_args = RayClassWithInitArgs(cls=VerlStyle)
        worker_group = RayWorkerGroup(
            resource_pool=resource_pool, ray_cls_with_init=cls_with_init_args,
            name_prefix="trainer", detached=True,
        )
        worker_group.init_model()
        bundles = [list(b) for b in resource_pool.to_resource_pool().bundles()]
        print(json.dumps({{"names": worker_group.worker_names,
                          "world_size": worker_group.world_size, "bundles": bundles}}))
    """)
    out = json.loads(server.strip().splitlines()[-1])
    group = "trainerVerlStyle"
    try:
        _round_trip(ray_driver, ns, out)
    finally:  # a failed check must not leave the detached group holding the session's CPUs
        with contextlib.suppress(Exception):  # gone already when the checks passed
            teardown_group(group_name=group, ray_namespace=ns, timeout_s=60)


def _round_trip(ray_driver: RayCluster, ns: str, out: dict[str, Any]) -> None:
    assert (
        out["names"] == ["trainerVerlStyle_0:0", "trainerVerlStyle_0:1"] and out["world_size"] == 2
    )
    # verl would ask 2 bundles of max_colocate_count=10 CPUs (never placeable on a small
    # cluster): each gets what the node can hold for the two processes
    if ray_driver.num_cpus:  # 0: a head this session did not start (TG_TEST_RAY_ADDRESS)
        each = min(10.0, ray_driver.num_cpus / 2)
        assert out["bundles"] == [[{"CPU": each}, {"CPU": each}]]

    client = ray_driver.run_python(f"""
        import json, ray, torch
        from tensordict import TensorDict
        from tgruntime.compat.verl import DataProto, RayClassWithInitArgs, RayWorkerGroup
        from tests.runtime.light_workers import VerlStyle

        ray.init(namespace={ns!r})
        worker_names = {out["names"]!r}
        cls_with_init_args = RayClassWithInitArgs(cls=VerlStyle)
        worker_group = RayWorkerGroup.from_detached(
            worker_names=worker_names, ray_cls_with_init=cls_with_init_args
        )
        before = worker_group.steps()
        input_ids = torch.arange(4 * 3).reshape(4, 3)
        data = DataProto(batch=TensorDict({{"input_ids": input_ids}}, batch_size=4), meta_info={{}})
        output = worker_group.train_model(data)
        # without the class: the group record describes the methods
        bare = RayWorkerGroup.from_detached(worker_names=worker_names)
        print(json.dumps({{"before": before, "after": bare.steps(),
                          "loss": output.batch["loss"].tolist(),
                          "world_size": worker_group.world_size}}))
    """)
    res = json.loads(client.strip().splitlines()[-1])
    assert res["before"] == [0, 0] and res["after"] == [1, 1] and res["world_size"] == 2
    assert res["loss"] == [1.0, 4.0, 7.0, 10.0]

    # The verl group is a regular published group: attach by name, then remove everything.
    group = "trainerVerlStyle"
    attached = WorkerGroup.attach(group_name=group, ray_namespace=ns)
    assert attached.steps() == [1, 1]
    report = teardown_group(group_name=group, ray_namespace=ns, timeout_s=60)
    assert (
        report.complete
        and len(report.actors_killed) == 2
        and len(report.placement_groups_removed) == 1
    )
    prefix = naming.placement_group_prefix(ray_namespace=ns, group_name=group)
    assert not [
        p
        for p in placement_group_table().values()
        if p["name"].startswith(prefix) and p["state"] != "REMOVED"
    ]


def test_bundle_size_fits_the_cluster(ray_driver: RayCluster) -> None:
    cpus = ray.cluster_resources()["CPU"]  # type: ignore[no-untyped-call]  # ray leaves it unannotated
    assert _bundle_cpus(10, 2) == pytest.approx(cpus / 2)
    assert _bundle_cpus(1, 1) == 1.0  # fits: verl's size is kept
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False).to_resource_pool()
    assert pool.actor_options()["num_cpus"] == pytest.approx(
        cpus / 2 / 10
    )  # room for 10 colocated groups
