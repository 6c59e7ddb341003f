"""Status computation from (RayCluster, pods, job, group record, actors)."""

from __future__ import annotations

import dataclasses
import datetime

from tests.operator.helpers import pod, raycluster_obj, trainergroup
from tg_operator import status as S
from tg_operator.dashboard import ActorInfo, JobInfo, describe_death_cause
from tgapi import TrainerGroupStatus
from tgapi.markers import GroupReady

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
NAMES = ("demoTrainer_0:0", "demoTrainer_0:1")
SCHED_MSG = (
    "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) had untolerated taint "
    "{nvidia.com/gpu: present}. preemption: 0/2 nodes are available."
)


def ready_pods() -> list[dict[str, object]]:
    return [pod("demo-head-x", node_type="head"), pod("demo-workers-a", node_type="worker")]


def obs(readiness: S.ClusterReadiness, **kw: object) -> S.Observation:
    return S.Observation(
        cluster_name="demo",
        dashboard_url="http://d:8265",
        ray_address="d:6379",
        readiness=readiness,
        **kw,  # type: ignore[arg-type]
    )


def record() -> GroupReady:
    return GroupReady(
        group_name="demo",
        ray_namespace="tg-team-a-demo",
        generation=1,
        worker_names=NAMES,
        world_size=2,
        mesh={"tp": 1, "pp": 1, "cp": 1, "dp": 2},
        worker_class="X",
    )


def actor(name: str, state: str = "ALIVE", *, start: int = 1, cause: str = "") -> ActorInfo:
    return ActorInfo(
        actor_id=f"id-{name}-{start}",
        name=name,
        state=state,
        ray_namespace="tg-team-a-demo",
        pid=100 + start,
        node_id="node-1",
        death_cause=cause,
        start_time_ms=start,
    )


def cond(st: TrainerGroupStatus, ctype: str) -> tuple[str, str]:
    c = next(c for c in st.conditions if c.type == ctype)
    return c.status, c.reason


# -- cluster readiness ------------------------------------------------------------------
def test_unschedulable_gpu_pod_reports_the_schedulers_message() -> None:
    pods = [
        pod("demo-head-x", node_type="head"),
        pod("demo-workers-a", node_type="worker", unschedulable=SCHED_MSG),
    ]
    r = S.kube_readiness(
        raycluster_obj=raycluster_obj(provisioned=False), pods=pods, cluster="demo"
    )
    assert not r.ready and r.reason == "Unschedulable"
    assert SCHED_MSG in r.message and "demo-workers-a" in r.message
    st = S.compute_status(tg=trainergroup(), previous=TrainerGroupStatus(), obs=obs(r), now=T0)
    assert st.phase == "ClusterProvisioning"
    assert SCHED_MSG in st.message
    assert cond(st, "RayClusterReady") == ("False", "Unschedulable")
    c = next(c for c in st.conditions if c.type == "RayClusterReady")
    assert SCHED_MSG in c.message


def test_missing_cluster_head_and_worker_counts() -> None:
    r = S.kube_readiness(raycluster_obj=None, pods=[], cluster="demo")
    assert (r.ready, r.reason) == (False, "RayClusterMissing")
    r = S.kube_readiness(
        raycluster_obj=raycluster_obj(),
        pods=[pod("h", node_type="head", ready=False), pod("w", node_type="worker")],
        cluster="demo",
    )
    assert (r.ready, r.reason) == (False, "HeadNotReady")
    r = S.kube_readiness(
        raycluster_obj=raycluster_obj(replicas=2),
        pods=[
            pod("h", node_type="head"),
            pod("w", node_type="worker"),
            pod("w2", node_type="worker", deleting=True),
        ],
        cluster="demo",
    )
    assert (r.ready, r.reason) == (False, "WorkersNotReady")
    assert "1/2 worker pods ready" in r.message


def test_ready_needs_kuberay_to_agree_and_the_dashboard_to_answer() -> None:
    r = S.kube_readiness(
        raycluster_obj=raycluster_obj(provisioned=False), pods=ready_pods(), cluster="demo"
    )
    assert (r.ready, r.reason) == (False, "KubeRayNotReady")
    # without the conditions feature gate, KubeRay's state field decides
    r = S.kube_readiness(
        raycluster_obj=raycluster_obj(provisioned=None, state="ready"),
        pods=ready_pods(),
        cluster="demo",
    )
    assert r.ready
    r = S.kube_readiness(raycluster_obj=raycluster_obj(), pods=ready_pods(), cluster="demo")
    assert r.ready and r.reason == "Ready"
    down = S.with_dashboard(r, dashboard_error="cannot connect: refused")
    assert (down.ready, down.reason) == (False, "DashboardUnreachable")
    assert "refused" in down.message
    assert S.with_dashboard(r, dashboard_error=None) == r


def test_replica_failure_is_reported() -> None:
    rc = raycluster_obj()
    rc["status"]["conditions"].append(
        {"type": "RayClusterReplicaFailure", "status": "True", "message": "quota exceeded"}
    )
    r = S.kube_readiness(raycluster_obj=rc, pods=ready_pods(), cluster="demo")
    assert not r.ready and "quota exceeded" in r.message


# -- phases ----------------------------------------------------------------------------
def _ready() -> S.ClusterReadiness:
    return S.kube_readiness(raycluster_obj=raycluster_obj(), pods=ready_pods(), cluster="demo")


def test_workers_starting_while_the_server_job_runs() -> None:
    job = JobInfo(submission_id="tg-x-g1", status="RUNNING", message="Job is currently running.")
    st = S.compute_status(
        tg=trainergroup(), previous=TrainerGroupStatus(), obs=obs(_ready(), job=job), now=T0
    )
    assert st.phase == "WorkersStarting"
    assert "tg-x-g1 is RUNNING" in st.message
    assert cond(st, "RayClusterReady") == ("True", "Ready")
    assert cond(st, "WorkersReady") == ("False", "Starting")
    assert st.world_size == 2 and st.worker_names == []
    assert st.ray_address == "d:6379" and st.dashboard_url == "http://d:8265"
    assert st.ray_namespace == "tg-team-a-demo" and st.ray_cluster_name == "demo"


def test_ready_publishes_names_in_rank_order_and_workers() -> None:
    actors = [actor(NAMES[1]), actor(NAMES[0])]
    st = S.compute_status(
        tg=trainergroup(),
        previous=TrainerGroupStatus(),
        obs=obs(_ready(), record=record(), actors=actors),
        now=T0,
    )
    assert st.phase == "Ready"
    assert st.worker_names == list(NAMES)
    assert [(w.rank, w.name, w.state) for w in st.workers] == [
        (0, NAMES[0], "ALIVE"),
        (1, NAMES[1], "ALIVE"),
    ]
    assert st.ready_workers == 2 and st.world_size == 2
    assert st.mesh is not None and st.mesh.dp == 2
    assert cond(st, "WorkersReady") == ("True", "AllAlive")
    assert cond(st, "Degraded") == ("False", "AsExpected")
    assert st.observed_generation == 1
    assert st.phase_since == "2026-01-01T12:00:00Z"


def test_dead_worker_is_degraded_with_rank_and_cause() -> None:
    cause = "The actor is dead because it was killed by `ray.kill`."
    actors = [actor(NAMES[0]), actor(NAMES[1], "DEAD", cause=cause)]
    st = S.compute_status(
        tg=trainergroup(),
        previous=TrainerGroupStatus(),
        obs=obs(_ready(), record=record(), actors=actors),
        now=T0,
    )
    assert st.phase == "Degraded"
    assert f"rank 1 ({NAMES[1]}) is DEAD: {cause}" in st.message
    assert cond(st, "Degraded") == ("True", "WorkerDied")
    assert cond(st, "WorkersReady") == ("False", "WorkerDied")
    assert st.ready_workers == 1
    assert [w.rank for w in S.dead_workers(st.workers)] == [1]


def test_missing_actor_counts_as_dead_and_alive_beats_stale_dead_entries() -> None:
    # a re-created group reuses names: the old DEAD actor and the new ALIVE one coexist
    actors = [actor(NAMES[0], "DEAD", start=1), actor(NAMES[0], "ALIVE", start=2)]
    st = S.compute_status(
        tg=trainergroup(),
        previous=TrainerGroupStatus(),
        obs=obs(_ready(), record=record(), actors=actors),
        now=T0,
    )
    assert st.workers[0].state == "ALIVE" and st.workers[0].pid == 102
    assert st.workers[1].state == "NOT_FOUND"
    assert st.phase == "Degraded"


def test_restarting_actor_is_degraded_but_not_dead() -> None:
    actors = [actor(NAMES[0]), actor(NAMES[1], "RESTARTING")]
    st = S.compute_status(
        tg=trainergroup(),
        previous=TrainerGroupStatus(),
        obs=obs(_ready(), record=record(), actors=actors),
        now=T0,
    )
    assert st.phase == "Degraded" and S.dead_workers(st.workers) == []
    assert cond(st, "Degraded") == ("True", "WorkersNotAlive")


def test_unreadable_state_api_is_degraded_not_dead() -> None:
    st = S.compute_status(
        tg=trainergroup(),
        previous=TrainerGroupStatus(),
        obs=obs(_ready(), record=record(), actors_error="HTTP 500: boom"),
        now=T0,
    )
    assert st.phase == "Degraded" and "HTTP 500: boom" in st.message
    assert cond(st, "WorkersReady") == ("Unknown", "StateUnavailable")


def test_cluster_lost_after_ready_is_degraded() -> None:
    before = S.compute_status(
        tg=trainergroup(),
        previous=TrainerGroupStatus(),
        obs=obs(_ready(), record=record(), actors=[actor(n) for n in NAMES]),
        now=T0,
    )
    r = S.kube_readiness(
        raycluster_obj=raycluster_obj(),
        pods=[pod("h", node_type="head", ready=False)],
        cluster="demo",
    )
    after = S.compute_status(
        tg=trainergroup(), previous=before, obs=obs(r), now=T0 + datetime.timedelta(seconds=5)
    )
    assert after.phase == "Degraded"
    assert cond(after, "Degraded") == ("True", "ClusterNotReady")
    assert after.worker_names == list(NAMES)  # the client contract is not withdrawn


def test_transition_times_move_only_on_status_change() -> None:
    r = S.kube_readiness(raycluster_obj=None, pods=[], cluster="demo")
    st1 = S.compute_status(tg=trainergroup(), previous=TrainerGroupStatus(), obs=obs(r), now=T0)
    later = T0 + datetime.timedelta(minutes=3)
    r2 = S.kube_readiness(raycluster_obj=raycluster_obj(), pods=[], cluster="demo")
    st2 = S.compute_status(tg=trainergroup(), previous=st1, obs=obs(r2), now=later)
    c1 = next(c for c in st1.conditions if c.type == "RayClusterReady")
    c2 = next(c for c in st2.conditions if c.type == "RayClusterReady")
    assert c2.reason != c1.reason and c2.last_transition_time == c1.last_transition_time
    assert st2.phase_since == st1.phase_since  # same phase
    assert S.seconds_in_phase(st2, now=later) == 180.0
    st3 = S.compute_status(tg=trainergroup(), previous=st2, obs=obs(_ready()), now=later)
    assert st3.phase == "WorkersStarting" and st3.phase_since == S.rfc3339(later)
    assert [c.type for c in st3.conditions] == ["RayClusterReady", "WorkersReady", "Degraded"]


def test_failed_and_terminating() -> None:
    st = S.failed(
        TrainerGroupStatus(), reason="ClusterTimeout", message="too slow", now=T0, generation=3
    )
    assert st.phase == "Failed" and st.message == "too slow" and st.observed_generation == 3
    assert cond(st, "RayClusterReady") == ("False", "ClusterTimeout")
    st = S.failed(TrainerGroupStatus(), reason="ServerFailed", message="boom", now=T0, generation=3)
    assert cond(st, "WorkersReady") == ("False", "ServerFailed")
    assert S.terminating(st, message="bye", now=T0).phase == "Terminating"
    assert dataclasses.replace(st) == st


def test_death_cause_is_flattened() -> None:
    cause = {
        "actor_died_error_context": {
            "error_message": "The actor is dead because it was killed by `ray.kill`.\nmore",
            "reason": "RAY_KILL",
        }
    }
    assert describe_death_cause(cause) == (
        "The actor is dead because it was killed by `ray.kill`. [RAY_KILL]"
    )
    assert describe_death_cause(None) == ""
