"""Pure status computation: what the world looks like → ``TrainerGroupStatus``.

Nothing here does I/O. The reconcile flow gathers an :class:`Observation` (the
RayCluster, its pods, the server job, the group record, the actors the State API
lists) and :func:`compute_status` turns it into the phase, the conditions
(RayClusterReady, WorkersReady, Degraded) and the client contract
(``workerNames``, ``rayNamespace``, ``rayAddress``). Readiness is honest: the
RayCluster's own conditions, every pod's Ready condition, and the scheduler's
Unschedulable message when a pod cannot be placed.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from tg_operator import names, raycluster
from tg_operator.dashboard import ActorInfo, JobInfo
from tgapi import Condition, MeshStatus, TrainerGroup, TrainerGroupStatus, WorkerStatus, markers
from tgapi import status as tgapi_status
from tgapi.workers import WorkerState, describe_worker, is_dead

RAY_CLUSTER_READY = "RayClusterReady"
WORKERS_READY = "WorkersReady"
DEGRADED = "Degraded"
QUEUED = tgapi_status.QUEUED
"""Also the readiness reason of a RayCluster that waits for Kueue's admission."""

ALIVE = WorkerState.ALIVE


def rfc3339(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return None


# -- cluster readiness ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterReadiness:
    ready: bool
    reason: str
    message: str
    unschedulable: tuple[str, ...] = ()
    expected_workers: int = 0  # the worker pods the RayCluster asks for


def _condition(obj: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == ctype:
            return c
    return None


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    c = _condition(pod, "Ready")
    return c is not None and c.get("status") == "True"


def _pod_unschedulable(pod: Mapping[str, Any]) -> str | None:
    c = _condition(pod, "PodScheduled")
    if c is not None and c.get("status") == "False" and c.get("reason") == "Unschedulable":
        name = pod.get("metadata", {}).get("name", "?")
        return f"pod {name} is unschedulable: {c.get('message') or 'no message'}"
    return None


def _kuberay_ready(rc: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether KubeRay itself calls the cluster ready, and why not."""
    failure = _condition(rc, "RayClusterReplicaFailure")
    if failure is not None and failure.get("status") == "True":
        return (
            False,
            f"KubeRay reports a replica failure: {failure.get('message') or failure.get('reason')}",
        )
    provisioned = _condition(rc, "RayClusterProvisioned")
    if provisioned is not None:
        if provisioned.get("status") == "True":
            return True, ""
        why = provisioned.get("message") or provisioned.get("reason") or "not provisioned"
        return False, f"KubeRay: {why}"
    state = rc.get("status", {}).get("state")
    if state == "ready":
        return True, ""
    return False, f"KubeRay state is {state or 'unset'}"


def kube_readiness(
    *, raycluster_obj: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]], cluster: str
) -> ClusterReadiness:
    """Readiness as Kubernetes sees it: the RayCluster's status and every pod's Ready."""
    if raycluster_obj is None:
        return ClusterReadiness(
            ready=False, reason="RayClusterMissing", message=f"RayCluster {cluster} does not exist"
        )
    if raycluster_obj.get("metadata", {}).get("deletionTimestamp"):
        return ClusterReadiness(
            ready=False,
            reason="RayClusterDeleting",
            message=f"RayCluster {cluster} is being deleted",
        )
    expected = raycluster.desired_worker_replicas(dict(raycluster_obj))
    heads = [
        p
        for p in pods
        if p.get("metadata", {}).get("labels", {}).get(names.RAY_NODE_TYPE_LABEL) == "head"
    ]
    workers = [
        p
        for p in pods
        if p.get("metadata", {}).get("labels", {}).get(names.RAY_NODE_TYPE_LABEL) == "worker"
    ]
    head_ready = any(_pod_ready(p) for p in heads)
    workers_ready = sum(1 for p in workers if _pod_ready(p))
    unschedulable = tuple(m for m in (_pod_unschedulable(p) for p in pods) if m)
    kuberay_ok, kuberay_why = _kuberay_ready(raycluster_obj)
    counts = (
        f"head pod {'ready' if head_ready else 'not ready'}, "
        f"{workers_ready}/{expected} worker pods ready"
    )
    if unschedulable:
        return ClusterReadiness(
            ready=False,
            reason="Unschedulable",
            message=f"RayCluster {cluster}: {counts}; " + "; ".join(unschedulable),
            unschedulable=unschedulable,
        )
    if not head_ready:
        return ClusterReadiness(
            ready=False, reason="HeadNotReady", message=f"RayCluster {cluster}: {counts}"
        )
    if workers_ready < expected:
        return ClusterReadiness(
            ready=False, reason="WorkersNotReady", message=f"RayCluster {cluster}: {counts}"
        )
    if not kuberay_ok:
        return ClusterReadiness(
            ready=False, reason="KubeRayNotReady", message=f"RayCluster {cluster}: {kuberay_why}"
        )
    return ClusterReadiness(
        ready=True,
        reason="Ready",
        message=f"RayCluster {cluster}: {counts}",
        expected_workers=expected,
    )


def with_dashboard(readiness: ClusterReadiness, *, dashboard_error: str | None) -> ClusterReadiness:
    """Readiness once the dashboard was probed (only meaningful when pods are ready)."""
    if not readiness.ready or dashboard_error is None:
        return readiness
    return ClusterReadiness(
        ready=False,
        reason="DashboardUnreachable",
        message=f"pods are ready but the Ray dashboard is not: {dashboard_error}",
    )


def with_ray_nodes(readiness: ClusterReadiness, *, alive_workers: int) -> ClusterReadiness:
    """Readiness once Ray's node table was read: every ready worker pod's raylet registered.

    A worker pod stays Ready for a while after its head restarted without GCS fault tolerance
    (its raylet only gives up on the lost GCS after a timeout); a group started then would
    find no worker node and fail as never placeable.
    """
    if not readiness.ready or alive_workers >= readiness.expected_workers:
        return readiness
    return ClusterReadiness(
        ready=False,
        reason="RayNodesMissing",
        message=f"pods are ready but Ray sees {alive_workers} of {readiness.expected_workers} "
        "worker nodes (a raylet not registered with the head yet, as after a head restart)",
    )


# -- workers ---------------------------------------------------------------------------
HEAD_LOST_CAUSE = (
    "the Ray head lost the group: no actor of its Ray namespace is known any more (the head "
    "restarted without spec.rayCluster.gcsFaultTolerance); the group is re-created and "
    "resumes from the last checkpoint in spec.training.checkpointDir, if any"
)


def worker_statuses(
    *, worker_names: Sequence[str], actors: Sequence[ActorInfo]
) -> list[WorkerStatus]:
    """One entry per worker name (rank order); an ALIVE actor wins over stale dead ones.

    No actor at all in the group's Ray namespace, not even a dead one, means Ray's GCS lost
    its state: the head restarted without GCS fault tolerance (a dead worker pod leaves its
    actors DEAD, with a cause). Each worker's cause then says so.
    """
    by_name: dict[str, ActorInfo] = {}
    for a in actors:
        seen = by_name.get(a.name)
        if seen is None or _prefer(a, seen):
            by_name[a.name] = a
    out = []
    for rank, name in enumerate(worker_names):
        found = by_name.get(name)
        if found is None:
            state, cause = describe_worker(ray_state=None)
            if not actors:
                cause = HEAD_LOST_CAUSE
            out.append(WorkerStatus(name=name, rank=rank, state=state, cause=cause))
            continue
        state, cause = describe_worker(ray_state=found.state, death_cause=found.death_cause)
        out.append(
            WorkerStatus(
                name=name,
                rank=rank,
                state=state,
                node=found.node_id,
                pid=found.pid,
                cause=cause,
            )
        )
    return out


def _prefer(new: ActorInfo, old: ActorInfo) -> bool:
    if (new.state == ALIVE) != (old.state == ALIVE):
        return bool(new.state == ALIVE)
    return new.start_time_ms >= old.start_time_ms


def dead_workers(workers: Sequence[WorkerStatus]) -> list[WorkerStatus]:
    return [w for w in workers if is_dead(w.state)]


def describe_dead(workers: Sequence[WorkerStatus], *, cause_chars: int = 240) -> str:
    """``rank R (NAME) is DEAD: cause`` for each dead worker (long causes shortened)."""
    parts = []
    for w in workers:
        cause = w.cause if len(w.cause) <= cause_chars else w.cause[: cause_chars - 3] + "..."
        parts.append(f"rank {w.rank} ({w.name}) is {w.state}: {cause}")
    return "; ".join(parts)


# -- conditions and phases -------------------------------------------------------------
def set_condition(
    conditions: Sequence[Condition],
    *,
    type: str,
    status: str,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int,
) -> list[Condition]:
    """Replace one condition; ``lastTransitionTime`` moves only when ``status`` does."""
    old = next((c for c in conditions if c.type == type), None)
    since = old.last_transition_time if old is not None and old.status == status else rfc3339(now)
    new = Condition(
        type=type,
        status=status,
        reason=reason,
        message=message[:1000],
        last_transition_time=since or rfc3339(now),
        observed_generation=generation,
    )
    kept = [c for c in conditions if c.type != type]
    order = {t: i for i, t in enumerate((RAY_CLUSTER_READY, WORKERS_READY, DEGRADED))}
    return sorted([*kept, new], key=lambda c: order.get(c.type, 99))


def with_phase(
    status: TrainerGroupStatus, *, phase: str, message: str, now: datetime.datetime
) -> TrainerGroupStatus:
    since = status.phase_since if status.phase == phase and status.phase_since else rfc3339(now)
    return dataclasses.replace(status, phase=phase, message=message[:1000], phase_since=since)


def seconds_in_phase(status: TrainerGroupStatus, *, now: datetime.datetime) -> float:
    since = parse_rfc3339(status.phase_since)
    return 0.0 if since is None else max(0.0, (now - since).total_seconds())


# -- the whole status ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """What the reconcile flow saw on one pass."""

    cluster_name: str
    dashboard_url: str
    ray_address: str
    readiness: ClusterReadiness
    job: JobInfo | None = None
    record: markers.GroupReady | None = None
    actors: Sequence[ActorInfo] | None = None
    """None when the actors could not be read (see ``actors_error``)."""
    actors_error: str = ""


def compute_status(
    *,
    tg: TrainerGroup,
    previous: TrainerGroupStatus,
    obs: Observation,
    now: datetime.datetime,
) -> TrainerGroupStatus:
    """The status for ``tg`` given what was observed.

    ``previous`` carries the group bookkeeping the flow owns (groupGeneration,
    submissionId, restarts, hashes); this function derives everything else.
    Failed and Terminating are set by the flow (:func:`failed`, :func:`terminating`).
    """
    gen = tg.generation
    st = dataclasses.replace(
        previous,
        observed_generation=gen,
        ray_cluster_name=obs.cluster_name,
        dashboard_url=obs.dashboard_url,
        ray_address=obs.ray_address,
        ray_namespace=tg.ray_namespace,
        group_name=tg.group_name,
        world_size=obs.record.world_size if obs.record else tg.spec.world_size,
    )
    if obs.record is not None:
        mesh = obs.record.mesh
        st = dataclasses.replace(
            st,
            worker_names=list(obs.record.worker_names),
            device=obs.record.device,
            backend=obs.record.backend,
            mesh=MeshStatus(
                tp=mesh.get("tp", 1),
                pp=mesh.get("pp", 1),
                cp=mesh.get("cp", 1),
                dp=mesh.get("dp", 1),
            ),
        )
    conds = list(st.conditions)
    r = obs.readiness
    conds = set_condition(
        conds,
        type=RAY_CLUSTER_READY,
        status="True" if r.ready else "False",
        reason=r.reason,
        message=r.message,
        now=now,
        generation=gen,
    )

    def workers_cond(status: str, reason: str, message: str) -> None:
        nonlocal conds
        conds = set_condition(
            conds,
            type=WORKERS_READY,
            status=status,
            reason=reason,
            message=message,
            now=now,
            generation=gen,
        )

    def degraded_cond(status: str, reason: str, message: str) -> None:
        nonlocal conds
        conds = set_condition(
            conds,
            type=DEGRADED,
            status=status,
            reason=reason,
            message=message,
            now=now,
            generation=gen,
        )

    if not r.ready and r.reason == QUEUED:
        # waiting for Kueue (first admission, or after a preemption): not a failure
        workers_cond("False", QUEUED, r.message)
        degraded_cond("False", QUEUED, "")
        st = with_phase(st, phase=QUEUED, message=r.message, now=now)
        st = dataclasses.replace(st, ready_workers=0)
    elif not r.ready:
        had_group = bool(st.worker_names)
        if had_group:
            workers_cond("Unknown", "ClusterNotReady", "the RayCluster is not ready")
            degraded_cond("True", "ClusterNotReady", r.message)
            st = with_phase(st, phase="Degraded", message=r.message, now=now)
        else:
            workers_cond("False", "ClusterNotReady", "waiting for the RayCluster")
            degraded_cond("False", "AsExpected", "")
            st = with_phase(st, phase="ClusterProvisioning", message=r.message, now=now)
        st = dataclasses.replace(st, ready_workers=0 if not had_group else st.ready_workers)
    elif obs.record is None:
        job = obs.job
        if job is None:
            msg = "submitting the server job"
        else:
            msg = f"server job {job.submission_id} is {job.status}"
            if job.message and not job.terminal:
                msg += f": {job.message}"
        workers_cond("False", "Starting", msg)
        degraded_cond("False", "AsExpected", "")
        st = dataclasses.replace(st, worker_names=[], workers=[], ready_workers=0, mesh=None)
        st = with_phase(st, phase="WorkersStarting", message=msg, now=now)
    elif obs.actors is None:
        msg = f"cannot read worker states: {obs.actors_error or 'unknown error'}"
        workers_cond("Unknown", "StateUnavailable", msg)
        degraded_cond("True", "StateUnavailable", msg)
        st = with_phase(st, phase="Degraded", message=msg, now=now)
    else:
        workers = worker_statuses(worker_names=st.worker_names, actors=obs.actors)
        alive = sum(1 for w in workers if w.state == ALIVE)
        st = dataclasses.replace(st, workers=workers, ready_workers=alive)
        if alive == len(workers) and workers:
            msg = f"{alive}/{len(workers)} workers alive"
            workers_cond("True", "AllAlive", msg)
            degraded_cond("False", "AsExpected", "")
            st = with_phase(st, phase="Ready", message=msg, now=now)
        else:
            dead = dead_workers(workers)
            if dead:
                reason, msg = "WorkerDied", describe_dead(dead)
            else:
                waiting = [w for w in workers if w.state != ALIVE]
                reason = "WorkersNotAlive"
                msg = "; ".join(f"rank {w.rank} ({w.name}) is {w.state}" for w in waiting)
            workers_cond("False", reason, msg)
            degraded_cond("True", reason, msg)
            st = with_phase(st, phase="Degraded", message=msg, now=now)
    return dataclasses.replace(st, conditions=conds)


def failed(
    status: TrainerGroupStatus,
    *,
    reason: str,
    message: str,
    now: datetime.datetime,
    generation: int,
) -> TrainerGroupStatus:
    """Phase Failed, with the reason on the WorkersReady condition (or RayClusterReady)."""
    conds = list(status.conditions)
    cluster_reasons = ("ClusterTimeout", "ClusterConflict", "ClaimAccessMode")
    ctype = RAY_CLUSTER_READY if reason in cluster_reasons else WORKERS_READY
    conds = set_condition(
        conds,
        type=ctype,
        status="False",
        reason=reason,
        message=message,
        now=now,
        generation=generation,
    )
    st = dataclasses.replace(status, conditions=conds, observed_generation=generation)
    return with_phase(st, phase="Failed", message=message, now=now)


def terminating(
    status: TrainerGroupStatus, *, message: str, now: datetime.datetime
) -> TrainerGroupStatus:
    return with_phase(status, phase="Terminating", message=message, now=now)
