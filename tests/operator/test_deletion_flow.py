"""The finalizer's steps (:func:`tg_operator.deletion.finalize_step`) against the fakes.

Time is simulated as in test_reconcile_flow.py: each step's delay moves the fake clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.operator.fakes import World, cluster_key, world
from tests.operator.test_reconcile_flow import drive, phase_is
from tg_operator import deletion, names
from tg_operator import deletion_rules as rules
from tg_operator.context import Step
from tg_operator.dashboard import JobInfo
from tgapi import parse_resource


def delete(w: World) -> None:
    w.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"


async def steps(w: World, *, limit: int = 20) -> list[Step]:
    """Cleanup steps as the group's loop makes them, until one is settled."""
    done: list[Step] = []
    for attempt in range(limit):
        step = await deletion.finalize_step(w.ctx, body=w.obj, sink=w.sink, attempt=attempt)
        done.append(step)
        if step.done:
            break
        w.clock.advance(step.delay)
    return done


def ready_then_deleted(**spec: Any) -> World:
    w = world(**spec)
    asyncio.run(drive(w, until=phase_is("Ready")))
    delete(w)
    return w


def test_cleanup_tears_down_checks_the_workers_forgets_the_jobs_then_deletes_the_cluster() -> None:
    w = ready_then_deleted()
    patches = w.kube.calls["patch_status"]
    done = asyncio.run(steps(w))
    # 1: stop nothing (the server job ended), submit the teardown job; 2: it succeeded ->
    # no worker of ours alive -> job records deleted -> the RayCluster deleted
    assert [s.done for s in done] == [False, True]
    assert "no live workers left" in done[-1].message
    assert "job records removed" in done[-1].message
    assert cluster_key(w) not in w.kube.clusters
    assert w.ray.jobs == {}  # the server and teardown records are forgotten
    assert w.status["phase"] == "Terminating"
    # one write: Terminating with the step's message; the last step changes nothing in it
    assert w.kube.calls["patch_status"] - patches == 1
    assert w.reasons()[-1] == "CleanedUp" and w.warnings() == []
    assert w.obj["metadata"]["uid"] not in w.ctx.written  # forgotten once settled


def test_unreachable_ray_retries_with_the_cleanup_backoff_then_force_removes_it() -> None:
    w = ready_then_deleted()
    w.ray.script.reachable = False
    done = asyncio.run(steps(w, limit=8))
    assert [s.delay for s in done] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert not any(s.done for s in done)
    st = w.status
    assert st["phase"] == "Terminating" and "cannot reach Ray" in st["message"]
    assert f'{names.FORCE_DELETE_ANNOTATION}="true"' in st["message"]
    # one event per distinct reason: the delay stops changing at the cap
    assert [r for _, r, _ in w.warnings()] == ["CleanupRetrying"] * 6
    w.obj["metadata"]["annotations"] = {names.FORCE_DELETE_ANNOTATION: "true"}
    (forced,) = asyncio.run(steps(w))
    assert forced.done and "removed without cleaning Ray" in forced.message
    assert w.warnings()[-1][1] == "ForceDeleted"
    assert cluster_key(w) in w.kube.clusters  # left to the garbage collector


def test_a_gone_cluster_needs_no_ray() -> None:
    w = ready_then_deleted()
    w.kube.clusters.pop(cluster_key(w))
    ray_calls = sum(w.ray.calls.values())
    (step,) = asyncio.run(steps(w))
    assert step.done and "is gone" in step.message
    assert sum(w.ray.calls.values()) == ray_calls
    assert w.reasons()[-1] == "NothingToClean"


def test_nothing_started_reads_the_server_job_and_the_cluster_and_leaves_it_to_the_gc() -> None:
    w = world()
    asyncio.run(drive(w, passes=1))  # the RayCluster is created, no job yet
    delete(w)
    kube_reads = w.kube.calls["get_raycluster"]
    (step,) = asyncio.run(steps(w))
    assert step.done and "no worker group was started" in step.message
    assert w.ray.calls["get_job"] == 1 and w.kube.calls["get_raycluster"] == kube_reads + 1
    assert cluster_key(w) in w.kube.clusters  # the garbage collector's
    assert w.kube.calls["delete_raycluster"] == 0


def test_nothing_started_but_a_cluster_finalizer_deletes_the_cluster_first_and_waits() -> None:
    """A queued GCS-FT group deleted before Kueue admitted it: KubeRay's finalizer is on its
    RayCluster all the same, and the cleanup Job needs the token Secret the group owns."""
    w = world()
    asyncio.run(drive(w, passes=1))
    with_kuberay_gcs_ft_finalizer(w)
    delete(w)
    done = asyncio.run(steps(w, limit=3))
    assert not any(s.done for s in done)
    assert w.kube.calls["delete_raycluster"] == 1
    assert w.kube.clusters[cluster_key(w)]["metadata"]["deletionTimestamp"]
    assert w.status["message"].startswith("waiting for RayCluster demo to finish deleting")
    assert w.ray.calls["submit_job"] == 0  # no teardown: nothing was started
    w.kube.drop_finalizers(*cluster_key(w))
    (last,) = asyncio.run(steps(w))
    assert last.done and cluster_key(w) not in w.kube.clusters
    assert w.warnings() == []


def test_a_server_job_the_status_never_recorded_is_cleaned_up() -> None:
    w = world()
    asyncio.run(drive(w, passes=1))
    sid = names.server_submission_id(parse_resource(w.obj), generation=0)
    w.ray.jobs[sid] = JobInfo(submission_id=sid, status="SUCCEEDED")
    delete(w)
    done = asyncio.run(steps(w))
    assert done[-1].done and "no live workers left" in done[-1].message
    assert w.ray.calls["submit_job"] == 1  # the teardown job
    assert cluster_key(w) not in w.kube.clusters


def test_an_invalid_spec_is_released_at_once() -> None:
    w = world()
    w.obj["spec"]["parallelism"] = {"tensor": 3}
    delete(w)
    (step,) = asyncio.run(steps(w))
    assert step.done and "the spec was invalid" in step.message
    assert sum(w.ray.calls.values()) == 0


def with_kuberay_gcs_ft_finalizer(w: World) -> None:
    """KubeRay's finalizer on a RayCluster with GCS fault tolerance (its Redis cleanup Job)."""
    w.kube.clusters[cluster_key(w)]["metadata"]["finalizers"] = [rules.GCS_FT_FINALIZER]


def test_the_group_outlives_a_raycluster_that_keeps_a_finalizer_for_a_while() -> None:
    """KubeRay's Redis cleanup Job uses the token Secret the group owns: wait for it."""
    w = ready_then_deleted()
    with_kuberay_gcs_ft_finalizer(w)
    patches = w.kube.calls["patch_status"]
    done = asyncio.run(steps(w, limit=2))
    # 1: the teardown job; 2: the chain up to the delete, but the RayCluster stays
    assert [s.done for s in done] == [False, False]
    assert done[-1].delay == rules.CLUSTER_FINALIZERS_POLL_S
    rc = w.kube.clusters[cluster_key(w)]
    assert rc["metadata"]["deletionTimestamp"]
    assert w.status["message"].startswith("waiting for RayCluster demo to finish deleting")
    assert rules.GCS_FT_FINALIZER in w.status["message"]
    assert w.reasons().count("CleanedUp") == 1
    reads = w.kube.calls["get_raycluster"]
    for _ in range(12):  # KubeRay's cleanup runs for ~25 s (steps moves the clock 2 s each)
        done = asyncio.run(steps(w, limit=1))
        assert not done[-1].done
    assert w.kube.calls["get_raycluster"] - reads == 12  # each step reads it afresh
    assert "20s so far, at most 330s" in w.status["message"]
    w.kube.drop_finalizers(*cluster_key(w))
    (last,) = asyncio.run(steps(w))
    assert last.done and last.message == "RayCluster demo finished deleting"
    assert cluster_key(w) not in w.kube.clusters
    assert w.reasons().count("CleanedUp") == 1 and "NothingToClean" not in w.reasons()
    assert w.warnings() == []
    # Terminating (the teardown), the wait at 0s, 10s and 20s: one write per 10 s, not per poll
    assert w.kube.calls["patch_status"] - patches == 4


def test_a_raycluster_finalizer_that_never_goes_is_waited_for_330s_then_warned_about() -> None:
    w = ready_then_deleted()
    with_kuberay_gcs_ft_finalizer(w)
    patches = w.kube.calls["patch_status"]
    t0 = w.clock()
    done = asyncio.run(steps(w, limit=400))
    assert done[-1].done and not any(s.done for s in done[:-1])
    waited = (w.clock() - t0).total_seconds()
    assert rules.CLUSTER_FINALIZERS_LIMIT_S <= waited <= rules.CLUSTER_FINALIZERS_LIMIT_S + 5
    ((_, reason, message),) = w.warnings()
    assert reason == "ClusterFinalizersTimeout" and rules.GCS_FT_FINALIZER in message
    assert f'{names.FORCE_DELETE_ANNOTATION}="true"' in message
    assert cluster_key(w) in w.kube.clusters  # left to KubeRay
    assert w.kube.calls["patch_status"] - patches <= 36


def test_force_delete_does_not_wait_for_the_raycluster_finalizers() -> None:
    w = ready_then_deleted()
    with_kuberay_gcs_ft_finalizer(w)
    asyncio.run(steps(w, limit=3))
    w.obj["metadata"]["annotations"] = {names.FORCE_DELETE_ANNOTATION: "true"}
    (forced,) = asyncio.run(steps(w))
    assert forced.done and w.warnings()[-1][1] == "ForceDeleted"
