"""Every outcome of :func:`tg_operator.decide.decide`, one table row each (pure, no fakes).

A row builds a snapshot (what one pass observed) and names the rule that must decide, the
action it must take and the phase it must write. The teardown outcomes are in
test_recreate.py; the same outcomes run through the executor and the fakes of both ports
in test_reconcile_flow.py.
"""

from __future__ import annotations

import datetime

import pytest

from tests.operator.fakes import T0
from tests.operator.helpers import pod, trainergroup
from tests.operator.snapshots import (
    READY_LINE,
    READY_PODS,
    SETTINGS,
    SID,
    actors,
    ago,
    cluster,
    job,
    running,
    snap,
)
from tg_operator import decide, entrypoints, observed
from tg_operator.snapshot import (
    CreateCluster,
    DeleteCluster,
    Snapshot,
    StopServer,
    SubmitServer,
    TearDown,
    WaitForSlot,
)
from tg_operator.status import rfc3339
from tgapi import TrainerGroupStatus

FOREIGN = {"metadata": {"name": "demo", "ownerReferences": []}, "spec": {}}
NEVER = trainergroup(restartPolicy="Never")
CHANGED = trainergroup(training={"batchSize": 8, "sequenceLength": 32})
NEW_CLUSTER = trainergroup(
    rayCluster={
        "head": {"cpu": "1", "memory": "2Gi"},
        "workers": {"replicas": 1, "gpusPerWorker": 2, "cpu": "3", "memory": "4Gi"},
    }
)

# id -> (snapshot, rule, action type, phase written, text in the message)
ROWS: dict[str, tuple[Snapshot, str, type | None, str, str]] = {
    "no-cluster-creates-it": (
        snap(raycluster=None, pods=()),
        "create-cluster",
        CreateCluster,
        "ClusterProvisioning",
        "head pod not ready",
    ),
    "foreign-cluster-conflicts": (
        snap(raycluster=FOREIGN),
        "cluster-conflict",
        None,
        "Failed",
        "not owned by this",
    ),
    "changed-cluster-hash-replaces-it": (
        snap(raycluster=cluster(cluster_hash="old")),
        "replace-cluster",
        DeleteCluster,
        "ClusterProvisioning",
        "replacing RayCluster demo",
    ),
    "pods-not-ready-waits": (
        snap(pods=READY_PODS[:1]),
        "cluster-not-ready",
        None,
        "ClusterProvisioning",
        "0/1 worker pods ready",
    ),
    "pods-not-ready-past-the-deadline-times-out": (
        snap(
            pods=READY_PODS[:1],
            status=TrainerGroupStatus(phase="ClusterProvisioning", phase_since=ago(3600)),
        ),
        "cluster-timeout",
        None,
        "Failed",
        "clusterReadySeconds",
    ),
    "unschedulable-pod-is-reported": (
        snap(pods=(READY_PODS[0], pod("w", node_type="worker", unschedulable="0/1 nodes"))),
        "cluster-not-ready",
        None,
        "ClusterProvisioning",
        "0/1 nodes",
    ),
    "dashboard-down-waits": (
        snap(dashboard_error="connection refused"),
        "cluster-not-ready",
        None,
        "ClusterProvisioning",
        "connection refused",
    ),
    "raylets-missing-waits": (
        snap(alive_worker_nodes=0),
        "cluster-not-ready",
        None,
        "ClusterProvisioning",
        "Ray sees 0 of 1 worker nodes",
    ),
    "no-job-submits-it": (
        snap(),
        "submit-server",
        SubmitServer,
        "WorkersStarting",
        "submitting the server job",
    ),
    "no-job-slot-waits": (
        snap(slot_free=False, slots_in_flight=3, slot_limit=3),
        "job-slot-wait",
        WaitForSlot,
        "WorkersStarting",
        "waiting for a free Ray job slot: 3 jobs",
    ),
    "ray-error-retries": (
        snap(ray_error="HTTP 500"),
        "ray-error",
        None,
        "Pending",
        "HTTP 500",
    ),
    "running-job-is-watched": (
        snap(job=job("RUNNING")),
        "job-running",
        None,
        "WorkersStarting",
        "is RUNNING",
    ),
    "job-running-too-long-times-out": (
        snap(job=job("RUNNING", started_s_ago=3600)),
        "workers-timeout",
        StopServer,
        "Failed",
        "workersReadySeconds",
    ),
    "failed-job-fails": (
        snap(job=job("FAILED"), job_logs="Traceback\nboom"),
        "server-failed",
        None,
        "Failed",
        "FAILED: exit 1 last output",
    ),
    "succeeded-job-without-ready-line-fails": (
        snap(job=job("SUCCEEDED"), job_logs="nothing"),
        "server-failed",
        None,
        "Failed",
        entrypoints.READY_MARKER,
    ),
    "succeeded-job-publishes-the-workers": (
        snap(job=job("SUCCEEDED"), job_logs=READY_LINE, actors=actors()),
        "watch",
        None,
        "Ready",
        "2/2 workers alive",
    ),
    "all-alive-is-ready": (
        snap(status=running(), actors=actors()),
        "watch",
        None,
        "Ready",
        "2/2 workers alive",
    ),
    "unreadable-actors-is-degraded-without-restart": (
        snap(status=running(), actors_error="timeout"),
        "watch",
        None,
        "Degraded",
        "cannot read worker states",
    ),
    "death-with-never-fails": (
        snap(tg=NEVER, status=running(), actors=actors("w0-1")),
        "worker-died",
        None,
        "Failed",
        "restartPolicy: Never",
    ),
    "first-death-restarts-at-once": (
        snap(status=running(), actors=actors("w0-1")),
        "restart",
        TearDown,
        "Degraded",
        "tearing down group generation 0",
    ),
    "later-death-schedules-the-back-off": (
        snap(status=running(restarts=2), actors=actors("w0-0")),
        "restart-scheduled",
        None,
        "Degraded",
        "restart 3/10 at",
    ),
    "back-off-not-due-waits": (
        snap(status=running(restarts=2, next_restart_time=ago(-15)), actors=actors("w0-0")),
        "restart-back-off",
        None,
        "Degraded",
        "(back-off)",
    ),
    "back-off-due-restarts": (
        snap(status=running(restarts=2, next_restart_time=ago(1)), actors=actors("w0-0")),
        "restart",
        TearDown,
        "Degraded",
        "tearing down",
    ),
    "max-restarts-reached-fails": (
        snap(status=running(restarts=10), actors=actors("w0-0")),
        "restart-limit",
        None,
        "Failed",
        "spec.maxRestarts (10) is reached",
    ),
    "group-spec-change-tears-down": (
        snap(tg=CHANGED, status=running()),
        "respec",
        TearDown,
        "WorkersStarting",
        "the group spec changed",
    ),
    "cluster-spec-change-tears-down": (
        snap(tg=NEW_CLUSTER, status=running()),
        "respec",
        TearDown,
        "WorkersStarting",
        "the cluster spec changed",
    ),
    "spec-change-revives-a-failed-group": (
        snap(status=running(phase="Failed")),
        "respec",
        TearDown,
        "Failed",
        "the spec changed after a failure",
    ),
}


@pytest.mark.parametrize(
    ("seen", "rule", "action", "phase", "text"), ROWS.values(), ids=ROWS.keys()
)
def test_decide(seen: Snapshot, rule: str, action: type | None, phase: str, text: str) -> None:
    d = decide.decide(seen, settings=SETTINGS)
    assert d.rule == rule, d
    assert (type(d.action) if d.action is not None else None) is action, d.action
    assert d.status.phase == phase, d.status
    assert text in d.status.message, d.status.message
    failed = phase == "Failed" and rule != "respec"  # a revived group stays Failed meanwhile
    assert (d.failure != "") == failed, d.failure
    assert d.step.done == (failed or rule == "watch"), d.step


def test_failures_name_their_reason_in_a_warning_and_on_a_condition() -> None:
    reasons = {
        "foreign-cluster-conflicts": "ClusterConflict",
        "pods-not-ready-past-the-deadline-times-out": "ClusterTimeout",
        "job-running-too-long-times-out": "WorkersTimeout",
        "failed-job-fails": "ServerFailed",
        "death-with-never-fails": "WorkerDied",
        "max-restarts-reached-fails": "RestartLimit",
    }
    for row, reason in reasons.items():
        d = decide.decide(ROWS[row][0], settings=SETTINGS)
        assert d.failure == reason and ("Warning", reason) in [(e.type, e.reason) for e in d.events]
        assert reason in {c.reason for c in d.status.conditions}, (row, d.status.conditions)


def test_the_back_off_doubles_and_is_recorded_in_next_restart_time() -> None:
    for restarts, wait in ((1, 10), (2, 20), (3, 40), (8, 300)):
        seen = snap(status=running(restarts=restarts), actors=actors("w0-0"))
        d = decide.decide(seen, settings=SETTINGS)
        assert d.rule == "restart-scheduled" and d.step.delay == wait
        assert d.status.next_restart_time == rfc3339(T0 + datetime.timedelta(seconds=wait))
        assert [e.reason for e in d.events] == ["Restarting"] and d.newly_dead == 1


def test_a_death_seen_again_is_not_counted_again() -> None:
    first = decide.decide(
        snap(status=running(restarts=2), actors=actors("w0-0")), settings=SETTINGS
    )
    again = decide.decide(snap(status=first.status, actors=actors("w0-0")), settings=SETTINGS)
    assert (first.newly_dead, again.newly_dead) == (1, 0) and again.events == ()


def test_the_slot_wait_books_nothing_and_the_submission_books_the_job() -> None:
    wait = decide.decide(ROWS["no-job-slot-waits"][0], settings=SETTINGS)
    submit = decide.decide(ROWS["no-job-submits-it"][0], settings=SETTINGS)
    assert wait.status.submission_id == "" and submit.status.submission_id == SID
    assert isinstance(submit.action, SubmitServer) and submit.action.submission_id == SID


def test_the_cluster_spec_change_teardown_knows_the_cluster_goes() -> None:
    group = decide.decide(ROWS["group-spec-change-tears-down"][0], settings=SETTINGS).action
    cluster_ = decide.decide(ROWS["cluster-spec-change-tears-down"][0], settings=SETTINGS).action
    revive = decide.decide(ROWS["spec-change-revives-a-failed-group"][0], settings=SETTINGS).action
    assert isinstance(group, TearDown) and not group.cluster_going and not group.fresh
    assert isinstance(cluster_, TearDown) and cluster_.cluster_going
    assert isinstance(revive, TearDown) and revive.fresh


@pytest.mark.parametrize(
    ("seen", "probe", "job"),
    [
        (snap(raycluster=None, pods=()), False, False),
        (snap(pods=READY_PODS[:1]), False, False),
        (snap(tg=CHANGED, status=running()), False, False),
        (snap(), True, True),
        (snap(status=running()), True, False),
    ],
    ids=["no-cluster", "pods-not-ready", "teardown-first", "no-group-yet", "group-recorded"],
)
def test_ray_is_read_only_when_kubernetes_is_ready(seen: Snapshot, probe: bool, job: bool) -> None:
    reads = observed.ray_reads(seen)
    assert (reads.probe, reads.job) == (probe, job)


def test_the_ray_namespace_is_the_recorded_one_else_the_specs() -> None:
    moved = running(ray_namespace="where-the-workers-are")
    assert observed.ray_namespace(snap(status=moved)) == "where-the-workers-are"
    assert observed.ray_namespace(snap()) == snap().tg.ray_namespace != ""
    stop = decide.decide(ROWS["job-running-too-long-times-out"][0], settings=SETTINGS).action
    assert isinstance(stop, StopServer) and stop.ray_namespace == snap().tg.ray_namespace
    teardown = decide.decide(snap(status=moved, tg=CHANGED), settings=SETTINGS).action
    assert isinstance(teardown, TearDown) and teardown.ray_namespace == "where-the-workers-are"
