"""One reconcile decision from one snapshot: a table of small pure rules.

:func:`decide` asks each rule of :data:`RULES` in order; the first that answers
decides. A rule looks at the :class:`~tg_operator.snapshot.Snapshot` and returns a
:class:`~tg_operator.snapshot.Decision` (the status to write, at most one action,
the events, when to look again) or None when its case does not apply. Nothing here
does I/O or reads a clock, so every outcome is a table row in
tests/operator/test_decide.py. What a snapshot says (its job id, the group record,
readiness) is read by :mod:`tg_operator.observed`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tg_operator import (
    claims,
    deaths,
    entrypoints,
    errors,
    names,
    observed,
    outcomes,
    owners,
    queue,
    raycluster,
    recreate,
    spec_change,
    tinker,
)
from tg_operator import status as status_mod
from tg_operator.context import Step
from tg_operator.snapshot import (
    Action,
    CreateCluster,
    Decision,
    DeleteCluster,
    ServeTinker,
    Settings,
    Snapshot,
    StopServer,
    SubmitServer,
    WaitForSlot,
)

WORKERS_GRACE_S = 60.0
"""Extra time the server job gets beyond ``workersReadySeconds`` (it has its own timeout)."""
WATCH_FALLBACK_S = 30.0
"""Longest sleep while the watches on the RayCluster and its pods should wake the group."""
DASHBOARD_POLL_S = 2.0
"""Pods are Ready but the dashboard does not answer yet (nothing watchable)."""
JOB_POLL_S = 1.0
"""Looking at a running server job (Ray has no watch)."""
TINKER_POLL_S = 1.0
"""After creating the Tinker server's objects (the Deployment watch usually wakes sooner)."""
SLOT_WAIT_S = 30.0
"""Fallback while waiting for a job slot (a freed slot wakes the waiters at once)."""

Rule = Callable[[Snapshot, Settings], Decision | None]


def respec(snap: Snapshot, cfg: Settings) -> Decision | None:
    """A spec change (or one reviving a Failed group) replaces the running group."""
    why = observed.teardown_reason(snap)
    if why is None:
        return None
    reason, fresh = why
    return recreate.plan(snap, rule="respec", base=snap.status, reason=reason, fresh=fresh)


def create_cluster(snap: Snapshot, cfg: Settings) -> Decision | None:
    tg = snap.tg
    if not names.owns_cluster(tg) or snap.raycluster is not None:
        return None
    body = raycluster.build_raycluster(tg, cluster_hash=spec_change.cluster_hash(tg.spec))
    ready = status_mod.kube_readiness(raycluster_obj=body, pods=(), cluster=names.cluster_name(tg))
    return _not_ready(snap, ready, rule="create-cluster", action=CreateCluster(body=body))


def cluster_conflict(snap: Snapshot, cfg: Settings) -> Decision | None:
    rc, tg = snap.raycluster, snap.tg
    if not names.owns_cluster(tg) or rc is None or owners.is_owned_by(dict(rc), tg):
        return None
    msg = (
        f"RayCluster {names.cluster_name(tg)} already exists and is not owned by this "
        "TrainerGroup: delete it, or use spec.rayClusterRef to run on it"
    )
    return outcomes.fail(
        snap, snap.status, rule="cluster-conflict", error=errors.ClusterConflict, message=msg
    )


def serve_tinker(snap: Snapshot, cfg: Settings) -> Decision | None:
    """The Tinker API server's Deployment is missing: create its objects (once each). It
    exists but serves an older spec: replace its pod template."""
    tg, seen = snap.tg, snap.tinker
    if seen is None or not tinker.wanted(tg):
        return None
    if seen.deployment is not None:
        return update_tinker(snap, cfg)
    if seen.just_created:
        return None  # created a moment ago: the Deployment watch wakes the group once it sees it
    if tg.spec.queue is not None and (snap.raycluster is None or queue.suspended(snap.raycluster)):
        return None  # a queued group holds no pod at all: its server starts once it is admitted
    action = ServeTinker(
        secret_name=tinker.keys_secret_name(tg), bodies=tinker.objects(tg, python=cfg.python)
    )
    msg = f"creating the Tinker API server {tinker.server_name(tg)}"
    # the Deployment watch wakes the group once it sees the new Deployment
    return Decision(
        rule="serve-tinker", status=snap.status, step=Step.wait(TINKER_POLL_S, msg), action=action
    )


def update_tinker(snap: Snapshot, cfg: Settings) -> Decision | None:
    tg, seen = snap.tg, snap.tinker
    if seen is None or not tinker.outdated(tg, seen.deployment, python=cfg.python):
        return None
    body = tinker.build_deployment(tg, python=cfg.python)
    action = ServeTinker(secret_name=tinker.keys_secret_name(tg), bodies=(body,), update=True)
    msg = f"updating the Tinker API server {tinker.server_name(tg)} (its spec changed)"
    return Decision(
        rule="update-tinker", status=snap.status, step=Step.wait(TINKER_POLL_S, msg), action=action
    )


def with_api_url(snap: Snapshot, decision: Decision) -> Decision:
    """``status.apiURL``: the Tinker API's URL while its Deployment is available, else empty
    (kept as it was when the pass did not look at the Deployment)."""
    tg = snap.tg
    if snap.tinker is None and tinker.wanted(tg):
        return decision
    url = tinker.api_url(tg, snap.tinker.deployment if snap.tinker is not None else None)
    if decision.status.api_url == url:
        return decision
    return dataclasses.replace(decision, status=dataclasses.replace(decision.status, api_url=url))


def replace_cluster(snap: Snapshot, cfg: Settings) -> Decision | None:
    if not names.owns_cluster(snap.tg) or snap.raycluster is None or not observed.outdated(snap):
        return None
    name = names.cluster_name(snap.tg)
    ready = status_mod.ClusterReadiness(
        ready=False,
        reason="RayClusterReplacing",
        message=f"replacing RayCluster {name} (its spec changed)",
    )
    return _not_ready(snap, ready, rule="replace-cluster", action=DeleteCluster(name=name))


def cluster_not_ready(snap: Snapshot, cfg: Settings) -> Decision | None:
    ready = observed.readiness(snap)
    return None if ready.ready else _not_ready(snap, ready, rule="cluster-not-ready")


def _not_ready(
    snap: Snapshot,
    ready: status_mod.ClusterReadiness,
    *,
    rule: str,
    action: Action | None = None,
) -> Decision:
    """Wait for the watches, or fail once ``timeouts.clusterReadySeconds`` has passed."""
    new = observed.status_from(snap, ready)
    limit = snap.tg.spec.timeouts.cluster_ready_seconds
    waited = status_mod.seconds_in_phase(new, now=snap.now)
    if new.phase == "ClusterProvisioning" and waited > limit:
        msg = (
            "the RayCluster was not ready within timeouts.clusterReadySeconds "
            f"({limit}s): {ready.message}"
        )
        return outcomes.fail(
            snap,
            new,
            rule="cluster-timeout",
            error=errors.ClusterTimeout,
            message=msg,
            action=action,
        )
    if ready.reason in ("DashboardUnreachable", "RayNodesMissing"):
        delay = DASHBOARD_POLL_S  # Ray has no watch: poll until it answers / the raylet joins
    elif new.phase == status_mod.QUEUED:
        delay = WATCH_FALLBACK_S  # no deadline while queued: the watch wakes on admission
    else:
        delay = min(WATCH_FALLBACK_S, max(1.0, limit - waited + 1.0))
    return Decision(rule=rule, status=new, step=Step.wait(delay, ready.message), action=action)


def ray_unreadable(snap: Snapshot, cfg: Settings) -> Decision | None:
    return outcomes.ray_failed(snap, snap.ray_error) if snap.ray_error else None


def submit_server(snap: Snapshot, cfg: Settings) -> Decision | None:
    if observed.recorded(snap) is not None or snap.job is not None:
        return None
    tg, sid, gen = snap.tg, observed.submission_id(snap), snap.status.group_generation
    if not snap.slot_free:
        msg = (
            f"waiting for a free Ray job slot: {snap.slots_in_flight} jobs in flight on "
            f"this Ray cluster (TG_MAX_CONCURRENT_JOBS={snap.slot_limit})"
        )
        new = observed.status_from(snap, observed.readiness(snap))
        st = status_mod.with_phase(new, phase=new.phase, message=msg, now=snap.now)
        return Decision(
            rule="job-slot-wait",
            status=st,
            step=Step.wait(SLOT_WAIT_S, msg),
            action=WaitForSlot(submission_id=sid),
        )
    action = SubmitServer(
        submission_id=sid,
        entrypoint=entrypoints.server_entrypoint(tg, python=cfg.python, generation=gen),
        metadata=entrypoints.job_metadata(tg, generation=gen),
    )
    st = observed.status_from(snap, observed.readiness(snap), previous=observed.booked(snap))
    return Decision(
        rule="submit-server",
        status=st,
        step=Step.wait(JOB_POLL_S, f"submitted server job {sid}"),
        action=action,
    )


def job_running(snap: Snapshot, cfg: Settings) -> Decision | None:
    job = snap.job
    if observed.recorded(snap) is not None or job is None or job.terminal:
        return None
    st = observed.status_from(snap, observed.readiness(snap), previous=observed.booked(snap))
    sid, limit = observed.submission_id(snap), snap.tg.spec.timeouts.workers_ready_seconds
    now_s = snap.now.timestamp()
    started = job.start_time_ms / 1000.0 if job.start_time_ms else now_s
    if now_s - started > limit + WORKERS_GRACE_S:
        msg = (
            f"server job {sid} did not finish within timeouts.workersReadySeconds "
            f"({limit}s) + {WORKERS_GRACE_S:g}s; it was stopped, and its workers "
            "are removed on deletion or on the next spec change"
        )
        stop = StopServer(
            generation=snap.status.group_generation,
            ray_namespace=observed.ray_namespace(snap),
        )
        return outcomes.fail(
            snap, st, rule="workers-timeout", error=errors.WorkersTimeout, message=msg, action=stop
        )
    return Decision(
        rule="job-running",
        status=st,
        step=Step.wait(JOB_POLL_S, f"server job {sid} is {job.status}"),
    )


def server_failed(snap: Snapshot, cfg: Settings) -> Decision | None:
    job = snap.job
    if observed.recorded(snap) is not None or job is None or not job.terminal:
        return None
    sid, logs = observed.submission_id(snap), snap.job_logs
    if job.status == "SUCCEEDED":
        if entrypoints.parse_group_ready(logs) is not None:
            return None
        msg = (
            f"server job {sid} succeeded but printed no {entrypoints.READY_MARKER} line; "
            f"last output: {entrypoints.tail(logs)}"
        )
    else:
        why = entrypoints.parse_group_failed(logs) or (
            f"{job.message} last output: {entrypoints.tail(logs)}"
        )
        msg = f"server job {sid} {job.status}: {why}"
    st = observed.status_from(snap, observed.readiness(snap), previous=observed.booked(snap))
    return outcomes.fail(snap, st, rule="server-failed", error=errors.ServerFailed, message=msg)


RULES: tuple[Rule, ...] = (
    respec,
    claims.refuse_claim,
    create_cluster,
    cluster_conflict,
    serve_tinker,
    replace_cluster,
    cluster_not_ready,
    ray_unreadable,
    submit_server,
    job_running,
    server_failed,
    deaths.workers,
)
"""The rules in the order they are asked; the first answer is the decision."""


def decide(snap: Snapshot, *, settings: Settings) -> Decision:
    """The one decision for ``snap``."""
    for rule in RULES:
        decision = rule(snap, settings)
        if decision is not None:
            return with_api_url(snap, decision)
    raise AssertionError(f"no rule decided for {snap.tg.namespace}/{snap.tg.name}")
