"""The finalizer's decisions: pure rules over a :class:`DeletionSnapshot` (like decide.py).

:func:`decide` asks the rules of :data:`RULES` in order; the first that answers gives the
one :class:`Cleanup`: the status to write, at most one action, the events, and when to
look again. Cleaning a group's Ray side is a chain of actions; :mod:`tg_operator.actions`
performs each and :func:`after` turns its outcome into the next decision::

    TearDownGroup (one teardown step) --done--> ListWorkers --none of ours alive-->
    ForgetJobs --> DeleteOwnedCluster (an owned RayCluster) --it had no finalizers--> settled
                       ^   (also at once when no group was started but the cluster has finalizers)
                       |
                       +--it had finalizers--> wait 2 s; the next steps read it again:
                            deleting, finalizers left  --> cluster-finalizing: wait 2 s
                            ... past the limit (330 s) --> settled, Warning
                            gone (or no finalizers)    --> cluster-finalized: settled

A teardown not done yet, or workers still alive, waits and looks again. So does an owned
RayCluster that is being deleted but still carries finalizers (KubeRay's
``ray.io/gcs-ft-redis-cleanup-finalizer`` with GCS fault tolerance: its Redis cleanup Job's pod
copies the head's env, the ``RAY_AUTH_TOKEN`` of the Secret ``<name>-ray-token`` included, and
that Secret is owned by the TrainerGroup, so the group must outlive the RayCluster), for at most
:data:`CLUSTER_FINALIZERS_LIMIT_S` from its ``deletionTimestamp``. Ray not answering
at any link retries after the cleanup back-off (:func:`tg_operator.backoff.cleanup_retry_s`)
and says why in the status, and in a ``CleanupRetrying`` event when the reason changed.
Nothing here does I/O or reads a clock: every outcome is a row of
tests/operator/test_deletion_rules.py.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping
from typing import Any

from tg_operator import backoff, names, observed
from tg_operator import status as status_mod
from tg_operator.context import Step
from tg_operator.dashboard import ActorInfo
from tg_operator.group_teardown import STEP_DELAY_S, TeardownResult
from tg_operator.snapshot import Event, Snapshot
from tgapi import TrainerGroupStatus

WORKERS_GONE_POLL_S = 2.0
"""The teardown finished but Ray still shows workers of ours alive: look again."""
CLUSTER_FINALIZERS_POLL_S = 2.0
"""The owned RayCluster is being deleted but still has finalizers: look again."""
CLUSTER_FINALIZERS_LIMIT_S = 330.0
"""How long after the RayCluster's ``deletionTimestamp`` the finalizer waits for its
finalizers at most: a little above KubeRay's 300 s deadline for its Redis cleanup Job."""
CLUSTER_FINALIZERS_STEP_S = 10
"""The status says how long the wait has lasted in steps of this many seconds, so it is
written every 10 s, not at every poll."""
GCS_FT_FINALIZER = "ray.io/gcs-ft-redis-cleanup-finalizer"
"""KubeRay's finalizer on a RayCluster with GCS fault tolerance (removed once its Redis cleanup
Job finished or hit its deadline)."""
WAITING_FOR_CLUSTER = "waiting for RayCluster "
"""How the status message of the wait begins (the next step reads it: the wait is over)."""
MESSAGE_LIMIT = 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeletionSnapshot:
    """A deleted TrainerGroup as one cleanup step observed it."""

    namespace: str
    name: str
    uid: str
    status: TrainerGroupStatus
    """The status the step starts from (the last one written)."""
    now: datetime.datetime
    attempt: int = 0
    """How many cleanup steps ran before this one (the back-off counts them)."""
    force: bool = False
    """The annotation ``trainergroup.io/force-delete`` is ``"true"``."""
    group: Snapshot | None = None
    """The group (None: its spec does not parse, so nothing was created): ``tg``, the
    dashboard URL (the recorded one first) and the owned RayCluster, read only when the
    rules get that far (:func:`wants_cluster`)."""
    server_job_seen: bool = False
    """A server job of the current generation exists in Ray although the status records
    none (the operator stopped between the submit and the status write); read only then
    (:func:`wants_job_probe`)."""


# -- actions: what the finalizer does, one link of the chain at a time ----------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TearDownGroup:
    """One step of :func:`tg_operator.group_teardown.teardown_group`."""

    generation: int
    ray_namespace: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ListWorkers:
    """Read the actors of the Ray namespace: the State API must show none of ours alive."""

    ray_namespace: str
    summary: str
    """What the teardown did."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForgetJobs:
    """Delete the finished job records of generations 0..N (best effort)."""

    up_to_generation: int
    summary: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeleteOwnedCluster:
    """Delete the owned RayCluster, once its Ray side is clean."""

    name: str


CleanupAction = TearDownGroup | ListWorkers | ForgetJobs | DeleteOwnedCluster


# -- outcomes: what an action reports back to :func:`after` ---------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Unreachable:
    """A dashboard call failed."""

    error: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class TornDown:
    result: TeardownResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkersListed:
    actors: tuple[ActorInfo, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobsForgotten:
    removed: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterDeleted:
    """The delete was sent; whether the RayCluster waits on finalizers, ``after`` reads from
    the snapshot's RayCluster (read just before)."""


Outcome = Unreachable | TornDown | WorkersListed | JobsForgotten | ClusterDeleted


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cleanup:
    """One decision of the finalizer: at most one action, then the status, then the events."""

    rule: str
    status: TrainerGroupStatus
    step: Step
    """Settled: the finalizer may go. Else: look again after ``step.delay``."""
    action: CleanupAction | None = None
    events: tuple[Event, ...] = ()


DeletionRule = Callable[[DeletionSnapshot], Cleanup | None]


# -- what to read --------------------------------------------------------------------------
def wants_job_probe(snap: DeletionSnapshot) -> bool:
    """Ask Ray for the server job: the status records none, but one may have been submitted."""
    return not snap.force and snap.group is not None and not snap.status.submission_id


def wants_cluster(snap: DeletionSnapshot) -> bool:
    """Read the owned RayCluster: whether or not a group was started on it, its finalizers
    decide whether the TrainerGroup must outlive it."""
    group = snap.group
    return not snap.force and group is not None and names.owns_cluster(group.tg)


# -- the rules, in order -------------------------------------------------------------------
def force_delete(snap: DeletionSnapshot) -> Cleanup | None:
    if not snap.force:
        return None
    where = (
        observed.ray_namespace(snap.group)
        if snap.group is not None
        else snap.status.ray_namespace or "?"
    )
    msg = (
        f"{names.FORCE_DELETE_ANNOTATION}=true: removed without cleaning Ray; "
        f"actors in Ray namespace {where} may remain"
    )
    return _settled(snap, rule="force-delete", message=msg, event=("Warning", "ForceDeleted"))


def invalid_spec(snap: DeletionSnapshot) -> Cleanup | None:
    if snap.group is not None:
        return None
    return _settled(
        snap, rule="invalid-spec", message="the spec was invalid, so nothing was created"
    )


def nothing_started(snap: DeletionSnapshot) -> Cleanup | None:
    """No group to clean. The owned RayCluster is left to the garbage collector, unless it
    has finalizers (KubeRay's GCS-FT one, even on a cluster Kueue never admitted): then it is
    deleted first and waited for, since its cleanup Job needs the token Secret the group
    owns, which the garbage collector would delete beside it."""
    if snap.status.submission_id or snap.server_job_seen:
        return None
    msg = "no worker group was started for the current generation"
    group = _group(snap)
    rc = group.raycluster
    if names.owns_cluster(group.tg) and rc is not None and _finalizers(rc):
        return Cleanup(
            rule="nothing-started-cluster-first",
            status=terminating(snap),
            step=Step.settled(msg),
            action=DeleteOwnedCluster(name=names.cluster_name(group.tg)),
        )
    return _settled(snap, rule="nothing-started", message=msg)


def cluster_finalizing(snap: DeletionSnapshot) -> Cleanup | None:
    """An owned RayCluster being deleted that still has finalizers: the group (and the token
    Secret it owns) must outlive it, so wait for them, up to the limit."""
    group = _group(snap)
    rc = group.raycluster
    if not names.owns_cluster(group.tg) or rc is None:
        return None
    if not rc.get("metadata", {}).get("deletionTimestamp") or not _finalizers(rc):
        return None
    return _wait_for_cluster(snap, events=())


def cluster_gone(snap: DeletionSnapshot) -> Cleanup | None:
    """An owned RayCluster that is gone (or going) took its Ray processes with it."""
    tg = _group(snap).tg
    rc = _group(snap).raycluster
    if not names.owns_cluster(tg):
        return None
    if rc is not None and not rc.get("metadata", {}).get("deletionTimestamp"):
        return None
    name = names.cluster_name(tg)
    prev = snap.status
    if prev.phase == "Terminating" and prev.message.startswith(WAITING_FOR_CLUSTER):
        # the end of the wait after a cleanup (CleanedUp was posted then): no second event
        msg = f"RayCluster {name} finished deleting"
        return _settled(snap, rule="cluster-finalized", message=msg)
    msg = f"RayCluster {name} is gone; its Ray processes went with it"
    return _settled(snap, rule="cluster-gone", message=msg, event=("Normal", "NothingToClean"))


def clean_ray(snap: DeletionSnapshot) -> Cleanup:
    group = _group(snap)
    action = TearDownGroup(
        generation=group.status.group_generation, ray_namespace=observed.ray_namespace(group)
    )
    return Cleanup(
        rule="clean-ray",
        status=terminating(snap),
        step=Step.wait(STEP_DELAY_S, "tearing down the workers"),
        action=action,
    )


RULES: tuple[DeletionRule, ...] = (
    force_delete,
    invalid_spec,
    cluster_finalizing,
    nothing_started,
    cluster_gone,
    clean_ray,
)
"""The rules in the order they are asked; the last always answers."""


def decide(snap: DeletionSnapshot) -> Cleanup:
    """The first decision of a cleanup step for ``snap``."""
    for rule in RULES:
        decision = rule(snap)
        if decision is not None:
            return decision
    raise AssertionError(f"no deletion rule decided for {snap.namespace}/{snap.name}")


# -- after an action: the next link of the chain -------------------------------------------
def after(snap: DeletionSnapshot, done: Cleanup, outcome: Outcome) -> Cleanup:
    """The decision once ``done.action`` ran and gave ``outcome``."""
    act, group = done.action, _group(snap)
    if isinstance(outcome, Unreachable):
        return _unreachable(snap, done, error=outcome.error)
    if isinstance(outcome, TornDown):
        assert isinstance(act, TearDownGroup), done
        result = outcome.result
        if not result.done:
            delay = backoff.RAY_RETRY_S if result.failed else STEP_DELAY_S
            msg = f"tearing down the workers: {result.message}"
            return _wait(snap, done, rule="tearing-down", message=msg, delay=delay)
        listed = ListWorkers(ray_namespace=act.ray_namespace, summary=result.message)
        return dataclasses.replace(done, rule="torn-down", action=listed)
    if isinstance(outcome, WorkersListed):
        assert isinstance(act, ListWorkers), done
        ours = set(group.status.worker_names)
        alive = sorted(a.name for a in outcome.actors if a.state != "DEAD" and a.name in ours)
        if alive:
            msg = f"teardown finished but workers are still alive: {', '.join(alive[:5])}"
            return _wait(snap, done, rule="workers-alive", message=msg, delay=WORKERS_GONE_POLL_S)
        forget = ForgetJobs(
            up_to_generation=group.status.group_generation,
            summary=f"{act.summary}; no live workers left in Ray namespace {act.ray_namespace}",
        )
        return dataclasses.replace(done, rule="workers-gone", action=forget)
    if isinstance(outcome, JobsForgotten):
        assert isinstance(act, ForgetJobs), done
        msg = f"{act.summary}; {outcome.removed} job records removed"
        tg = group.tg
        last = DeleteOwnedCluster(name=names.cluster_name(tg)) if names.owns_cluster(tg) else None
        return Cleanup(
            rule="cleaned-up",
            status=done.status,
            step=Step.settled(msg),
            action=last,
            events=(*done.events, Event(type="Normal", reason="CleanedUp", message=msg)),
        )
    # ClusterDeleted: the chain's end, unless the RayCluster had finalizers when read
    rc = group.raycluster
    if rc is not None and _finalizers(rc):
        return _wait_for_cluster(snap, events=done.events)
    return dataclasses.replace(done, action=None)


# -- helpers -------------------------------------------------------------------------------
def terminating(snap: DeletionSnapshot, message: str | None = None) -> TrainerGroupStatus:
    """Phase Terminating; without ``message``, the current one (or "cleaning up")."""
    prev = snap.status
    if message is None:
        message = prev.message if prev.phase == "Terminating" else "cleaning up"
    return status_mod.terminating(prev, message=message[:MESSAGE_LIMIT], now=snap.now)


def _finalizers(rc: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(f) for f in rc.get("metadata", {}).get("finalizers") or ())


def _deleting_for_s(snap: DeletionSnapshot, rc: Mapping[str, Any]) -> float:
    """Seconds since the RayCluster's ``deletionTimestamp`` (0 before it has one: just
    deleted); since the phase became Terminating if that does not parse, else the limit."""
    stamp = rc.get("metadata", {}).get("deletionTimestamp")
    if not stamp:
        return 0.0
    since = status_mod.parse_rfc3339(str(stamp)) or status_mod.parse_rfc3339(
        snap.status.phase_since or ""
    )
    if since is None:
        return CLUSTER_FINALIZERS_LIMIT_S
    return max(0.0, (snap.now - since).total_seconds())


def _waits_for(finalizers: tuple[str, ...]) -> str:
    if GCS_FT_FINALIZER in finalizers:
        return "KubeRay's cleanup of the group's GCS state in Redis, a Job with a 300s deadline"
    return "the controllers that own them"


def _wait_for_cluster(snap: DeletionSnapshot, *, events: tuple[Event, ...]) -> Cleanup:
    """Wait for the owned RayCluster's finalizers, or past the limit settle with a Warning."""
    group = _group(snap)
    rc = group.raycluster
    assert rc is not None
    name, fins = names.cluster_name(group.tg), _finalizers(rc)
    elapsed = _deleting_for_s(snap, rc)
    what = _waits_for(fins)
    if elapsed >= CLUSTER_FINALIZERS_LIMIT_S:
        msg = (
            f"RayCluster {name} still has the finalizers {', '.join(fins)} {elapsed:.0f}s after "
            f"it was deleted (waiting for {what}); the TrainerGroup goes anyway after "
            f"{CLUSTER_FINALIZERS_LIMIT_S:.0f}s and the RayCluster stays until they are "
            f"removed. To remove a TrainerGroup without waiting (and without cleaning Ray), "
            f'annotate it {names.FORCE_DELETE_ANNOTATION}="true"'
        )
        warning = Event(type="Warning", reason="ClusterFinalizersTimeout", message=msg)
        return Cleanup(
            rule="cluster-finalizers-timeout",
            status=terminating(snap),
            step=Step.settled(msg),
            events=(*events, warning),
        )
    shown = int(elapsed) // CLUSTER_FINALIZERS_STEP_S * CLUSTER_FINALIZERS_STEP_S
    msg = (
        f"{WAITING_FOR_CLUSTER}{name} to finish deleting: it still has the finalizers "
        f"{', '.join(fins)} (waiting for {what}); {shown}s so far, at most "
        f"{CLUSTER_FINALIZERS_LIMIT_S:.0f}s"
    )
    return Cleanup(
        rule="cluster-finalizing",
        status=terminating(snap, msg),
        step=Step.wait(CLUSTER_FINALIZERS_POLL_S, msg),
        events=events,
    )


def _group(snap: DeletionSnapshot) -> Snapshot:
    assert snap.group is not None, "asked after invalid_spec"
    return snap.group


def _settled(
    snap: DeletionSnapshot, *, rule: str, message: str, event: tuple[str, str] | None = None
) -> Cleanup:
    events = () if event is None else (Event(type=event[0], reason=event[1], message=message),)
    return Cleanup(rule=rule, status=terminating(snap), step=Step.settled(message), events=events)


def _wait(
    snap: DeletionSnapshot, done: Cleanup, *, rule: str, message: str, delay: float
) -> Cleanup:
    return Cleanup(
        rule=rule,
        status=terminating(snap, message),
        step=Step.wait(delay, message),
        events=done.events,
    )


def _unreachable(snap: DeletionSnapshot, done: Cleanup, *, error: str) -> Cleanup:
    delay = backoff.cleanup_retry_s(attempt=snap.attempt)
    why = (
        f"cannot reach Ray to remove the workers ({error}); retrying in {delay:g}s. "
        f"To remove the object without cleaning Ray, annotate it "
        f'{names.FORCE_DELETE_ANNOTATION}="true"'
    )
    events = done.events
    if terminating(snap).message != why:  # the same reason again: no second event
        events = (*events, Event(type="Warning", reason="CleanupRetrying", message=why))
    return Cleanup(
        rule="ray-unreachable",
        status=terminating(snap, why),
        step=Step.wait(delay, why),
        events=events,
    )
