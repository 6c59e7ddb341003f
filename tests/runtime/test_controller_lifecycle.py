"""Group lifecycle on a real local Ray: create in one process, attach from another,
teardown, dead workers, placement timeouts, failed constructors, lookup errors."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, cast

import pytest
import ray
from ray.actor import ActorHandle

from tests.fixtures_ray import RayCluster
from tests.runtime.light_workers import Broken, Counter
from tgruntime.controller import (
    ClassWithInitArgs,
    GroupExistsError,
    GroupNotFoundError,
    NamespaceMismatchError,
    PlacementInfeasibleError,
    PlacementTimeoutError,
    ResourcePool,
    WorkerDiedError,
    WorkerGroup,
    WorkerStartError,
    naming,
    registry,
    teardown_group,
)
from tgruntime.controller.health import dashboard_url

pytestmark = pytest.mark.ray

LIGHT_POOL = ResourcePool(process_on_nodes=[2], cpus_per_process=0.1)


def live_actors(namespace: str) -> list[Any]:
    from ray.util.state import list_actors

    return [
        a
        for a in list_actors(
            address=dashboard_url(), filters=[("ray_namespace", "=", namespace)], limit=1000
        )
        if a.state != "DEAD"
    ]


def live_placement_groups(namespace: str, group_name: str) -> list[Any]:
    from ray.util.state import list_placement_groups

    prefix = naming.placement_group_prefix(ray_namespace=namespace, group_name=group_name)
    return [
        p for p in list_placement_groups(address=dashboard_url(), limit=1000)
        if p.name.startswith(prefix) and p.state != "REMOVED"
    ]


def test_create_in_one_process_attach_from_another_then_teardown(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    ns = unique_namespace
    created = ray_driver.run_python(f"""
        import json
        from tgruntime.controller.connect import connect
        from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
        from tests.runtime.light_workers import Counter
        connect(ray_namespace="creator")  # another namespace than the group's: names are explicit
        wg = WorkerGroup.create(
            group_name="life", ray_namespace={ns!r},
            resource_pool=ResourcePool(process_on_nodes=[2], cpus_per_process=0.1),
            cls=ClassWithInitArgs(Counter, start=100), name_prefix="trainer",
            mesh={{"tp": 1, "dp": 2}}, actor_timeout_s=180,
        )
        wg.add(1)
        print(json.dumps(wg.worker_names))
    """)
    names = json.loads(created.strip().splitlines()[-1])
    assert names == ["trainerCounter_0:0", "trainerCounter_0:1"]

    # The creating process has exited; the detached workers kept their state.
    attached = ray_driver.run_python(f"""
        import json, time
        from tgruntime.controller.connect import connect
        from tgruntime.controller import WorkerGroup
        connect(ray_namespace="client")
        # warm-up (imports, first lookup)
        WorkerGroup.attach(group_name="life", ray_namespace={ns!r})
        t = time.perf_counter()
        wg = WorkerGroup.attach(group_name="life", ray_namespace={ns!r})
        took = time.perf_counter() - t
        print(json.dumps({{"took": took, "add": wg.add(5), "who": wg.whoami(),
                          "mesh": dict(wg.record.mesh), "scaled": wg.scaled([1, 1]),
                          "leader": wg.leader(7)}}))
    """)
    out = json.loads(attached.strip().splitlines()[-1])
    assert out["add"] == [106, 106]
    assert [w["rank"] for w in out["who"]] == [0, 1] and [w["name"] for w in out["who"]] == names
    assert out["mesh"] == {"tp": 1, "dp": 2}
    assert out["scaled"] == [1, 2] and out["leader"] == [0, 7]
    assert out["took"] > 0  # how long it takes is measured by bench/bench_controller.py

    # Same name again: refused before anything is placed.
    with pytest.raises(GroupExistsError, match="life"):
        WorkerGroup.create(
            group_name="life", ray_namespace=ns, resource_pool=LIGHT_POOL, cls=Counter
        )

    assert len(live_actors(ns)) == 2 and len(live_placement_groups(ns, "life")) == 1
    report = teardown_group(group_name="life", ray_namespace=ns, timeout_s=60)
    assert report.complete, report
    assert set(report.actors_killed) == set(names) and len(report.placement_groups_removed) == 1
    assert live_actors(ns) == [] and live_placement_groups(ns, "life") == []
    with pytest.raises(GroupNotFoundError):
        WorkerGroup.attach(group_name="life", ray_namespace=ns, timeout_s=0)
    again = teardown_group(group_name="life", ray_namespace=ns)
    assert again.complete and not again.removed_anything


def test_killed_worker_is_dead_in_health_and_calls_fail_fast(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    wg = WorkerGroup.create(
        group_name="victim",
        ray_namespace=unique_namespace,
        resource_pool=LIGHT_POOL,
        cls=Counter,
        actor_timeout_s=180,
    )
    try:
        pids = [w["pid"] for w in wg.whoami()]
        # rank 0 is busy in a long call when rank 1 dies: the call must fail at once, not
        # after rank 0 finishes (a collective would never finish).
        errors: list[BaseException] = []
        caller = threading.Thread(target=lambda: _capture(errors, wg.sleep, 25))
        caller.start()
        time.sleep(2)
        os.kill(pids[1], signal.SIGKILL)
        caller.join(timeout=20)
        assert not caller.is_alive(), "the call hung after a worker died"
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError), errors
        assert errors[0].rank == 1 and errors[0].worker_name == wg.worker_names[1]

        deadline = time.monotonic() + 30
        while True:
            health = wg.health(timeout_s=10)
            if health[1].state == "DEAD" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert health[1].state == "DEAD" and health[1].rank == 1 and health[1].pid == pids[1]
        assert health[1].cause
        assert health[0].state == "ALIVE"

        with pytest.raises(WorkerDiedError) as info:
            wg.add(1)
        assert info.value.rank == 1 and "victim" in str(info.value)

        # Attaching now: strict refuses, tolerant attaches and reports the dead rank.
        with pytest.raises(WorkerDiedError, match="rank 1"):
            WorkerGroup.attach(group_name="victim", ray_namespace=unique_namespace)
        tolerant = WorkerGroup.attach(
            group_name="victim", ray_namespace=unique_namespace, strict=False
        )
        assert [h.state for h in tolerant.health()] == ["ALIVE", "DEAD"]
    finally:
        report = wg.teardown()
    assert report.complete
    assert live_actors(unique_namespace) == []


def _capture(errors: list[BaseException], fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)


def test_placement_timeout_is_clear_and_leaves_nothing(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    # Feasible by the cluster's totals but held by another placement group: a bounded wait.
    # (A group the totals can never hold fails at once instead: tests/runtime/test_gpu_auto.py.)
    from ray.util.placement_group import placement_group, remove_placement_group

    free = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]  # ray leaves it unannotated
    blocker = placement_group([{"CPU": free}], strategy="STRICT_PACK") if free > 0 else None
    try:
        assert blocker is None or blocker.wait(timeout_seconds=60)
        held = ResourcePool(process_on_nodes=[2], cpus_per_process=0.5)
        with pytest.raises(PlacementTimeoutError) as info:  # its message names the 3 s wait
            WorkerGroup.create(
                group_name="huge",
                ray_namespace=unique_namespace,
                resource_pool=held,
                cls=Counter,
                pg_timeout_s=3,
            )
        text = str(info.value)
        assert "'huge'" in text and "3s" in text and "CPU=1" in text and "STRICT_PACK" in text
        # what the cluster has
        assert f"CPU={ray.cluster_resources()['CPU']:g}" in text  # type: ignore[no-untyped-call]  # ray leaves it unannotated
        assert live_placement_groups(unique_namespace, "huge") == []
        assert registry.load_members(group_name="huge", ray_namespace=unique_namespace) is None
    finally:
        if blocker is not None:
            remove_placement_group(blocker)
    gpus = ResourcePool(process_on_nodes=[1], use_gpu=True, gpus_per_process=1)
    with pytest.raises(PlacementInfeasibleError, match="GPU=1"):
        WorkerGroup.create(
            group_name="gpu",
            ray_namespace=unique_namespace,
            resource_pool=gpus,
            cls=Counter,
            pg_timeout_s=600,
        )


def test_failing_constructor_is_reported_and_cleaned(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    with pytest.raises(WorkerStartError, match="constructor exploded") as info:
        WorkerGroup.create(
            group_name="broken",
            ray_namespace=unique_namespace,
            resource_pool=LIGHT_POOL,
            cls=Broken,
            actor_timeout_s=180,
        )
    assert info.value.group_name == "broken" and info.value.rank in (0, 1)
    assert (
        live_actors(unique_namespace) == []
        and live_placement_groups(unique_namespace, "broken") == []
    )
    assert registry.load_members(group_name="broken", ray_namespace=unique_namespace) is None


def test_lookup_errors_name_what_exists(ray_driver: RayCluster, unique_namespace: str) -> None:
    other = unique_namespace + "-other"
    record = registry.GroupRecord(
        group_name="elsewhere", ray_namespace=other, worker_names=("x_0:0",), world_size=1, mesh={},
        worker_class="m:C", generation=0, created_at=0.0,
    )
    registry.publish_record(record)
    try:
        # an unknown name fails at once: with no record there is nothing to wait for, so even
        # a 10-minute attach timeout ends in GroupNotFoundError (pytest-timeout guards a hang)
        with pytest.raises(GroupNotFoundError, match="nope") as nf:
            WorkerGroup.attach(group_name="nope", ray_namespace=unique_namespace, timeout_s=600)
        assert unique_namespace in str(nf.value)
        with pytest.raises(NamespaceMismatchError, match=other):
            WorkerGroup.attach(group_name="elsewhere", ray_namespace=unique_namespace)
    finally:
        registry.delete_group_keys(group_name="elsewhere", ray_namespace=other)

    # A named actor in another namespace: attaching by its name says where it is.
    plain = ray.remote(num_cpus=0.01)(_Plain).options(name="lonely_0:0", namespace=other)
    # ray types .remote() as handle-or-class; an options() call on an actor class gives a handle
    actor = cast("ActorHandle[_Plain]", plain.remote())
    ray.get(actor.ping.remote())
    try:
        with pytest.raises(NamespaceMismatchError, match=other):
            WorkerGroup.from_worker_names(
                worker_names=["lonely_0:0"], ray_namespace=unique_namespace, worker_cls=Counter
            )
        with pytest.raises(GroupNotFoundError, match="no live actor named 'ghost_0:0'"):
            WorkerGroup.from_worker_names(
                worker_names=["ghost_0:0"], ray_namespace=unique_namespace, worker_cls=Counter
            )
    finally:
        ray.kill(actor)


class _Plain:
    def ping(self) -> int:
        return 1


def test_group_class_accepts_bare_class_and_validates_names(ray_driver: RayCluster) -> None:
    with pytest.raises(ValueError, match="invalid group name"):
        WorkerGroup.create(
            group_name="bad:name",
            ray_namespace="x",
            resource_pool=LIGHT_POOL,
            cls=ClassWithInitArgs(Counter),
        )
