"""The finalizer's steps (:func:`tg_operator.deletion.finalize_step`) against the fakes.

Time is simulated as in test_reconcile_flow.py: each step's delay moves the fake clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.operator.fakes import World, cluster_key, world
from tests.operator.test_reconcile_flow import drive, phase_is
from tg_operator import deletion, names
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


def test_nothing_started_reads_nothing_but_the_server_job() -> None:
    w = world()
    asyncio.run(drive(w, passes=1))  # the RayCluster is created, no job yet
    delete(w)
    kube_reads = w.kube.calls["get_raycluster"]
    (step,) = asyncio.run(steps(w))
    assert step.done and "no worker group was started" in step.message
    assert w.ray.calls["get_job"] == 1 and w.kube.calls["get_raycluster"] == kube_reads
    assert cluster_key(w) in w.kube.clusters  # the garbage collector's


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
