"""Losing the Ray head without GCS fault tolerance: the status says the head lost the group.

A new GCS knows no actor of the group's Ray namespace (a killed worker pod leaves DEAD actors
with a cause instead); the operator re-creates the group and each worker's cause, the Degraded
condition and the phase message say why. Pure decision logic (tg_operator.status).
"""

from __future__ import annotations

from tg_operator import status as S
from tg_operator.dashboard import ActorInfo
from tgapi.workers import NOT_FOUND_CAUSE


def test_no_actor_left_in_the_namespace_says_the_head_lost_the_group() -> None:
    workers = S.worker_statuses(worker_names=["w0", "w1"], actors=[])
    assert [w.state for w in workers] == ["NOT_FOUND", "NOT_FOUND"]
    assert all(w.cause == S.HEAD_LOST_CAUSE for w in workers)
    assert "gcsFaultTolerance" in S.HEAD_LOST_CAUSE
    said = S.describe_dead(workers)
    assert said.startswith("rank 0 (w0) is NOT_FOUND: the Ray head lost the group")


def test_one_missing_worker_among_known_actors_is_only_not_found() -> None:
    alive = ActorInfo.from_wire({"name": "w1", "state": "ALIVE", "pid": 7, "actor_id": "b"})
    w0, w1 = S.worker_statuses(worker_names=["w0", "w1"], actors=[alive])
    assert (w0.state, w0.cause) == ("NOT_FOUND", NOT_FOUND_CAUSE)
    assert (w1.state, w1.cause) == ("ALIVE", "")



def _ready(expected: int) -> S.ClusterReadiness:
    return S.ClusterReadiness(ready=True, reason="Ready", message="ok", expected_workers=expected)


def test_ready_pods_whose_raylets_have_not_registered_are_not_ready() -> None:
    # after a head restart the old worker pod stays Ready until its raylet gives up
    got = S.with_ray_nodes(_ready(1), alive_workers=0)
    assert (got.ready, got.reason) == (False, "RayNodesMissing")
    assert "Ray sees 0 of 1 worker nodes" in got.message


def test_every_raylet_registered_keeps_the_readiness() -> None:
    assert S.with_ray_nodes(_ready(1), alive_workers=1) == _ready(1)
    assert S.with_ray_nodes(_ready(0), alive_workers=0) == _ready(0)
    waiting = S.ClusterReadiness(ready=False, reason="HeadNotReady", message="head")
    assert S.with_ray_nodes(waiting, alive_workers=0) is waiting


def test_kube_readiness_carries_the_expected_worker_count() -> None:
    rc = {"metadata": {"name": "g"}, "spec": {"workerGroupSpecs": [{"replicas": 2}]},
          "status": {"state": "ready", "conditions": [
              {"type": "HeadPodReady", "status": "True"},
              {"type": "RayClusterProvisioned", "status": "True"}]}}
    pods = [{"metadata": {"labels": {"ray.io/node-type": t}},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
            for t in ("head", "worker", "worker")]
    got = S.kube_readiness(raycluster_obj=rc, pods=pods, cluster="g")
    assert got.ready, got
    assert got.expected_workers == 2
