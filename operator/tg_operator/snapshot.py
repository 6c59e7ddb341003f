"""What one reconcile pass saw (:class:`Snapshot`) and what it decided (:class:`Decision`).

Plain frozen data, no I/O. :mod:`tg_operator.reconcile` gathers a snapshot through the
ports, :func:`tg_operator.decide.decide` turns it into one decision, and the executor
performs the decision's one :data:`Action`, writes its status and posts its events.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from tg_operator.context import Step
from tg_operator.dashboard import ActorInfo, JobInfo
from tg_operator.settings import OperatorConfig
from tgapi import TrainerGroup, TrainerGroupStatus
from tgapi.progress import TrainingProgress


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """The operator settings the decisions depend on."""

    python: str = "python"
    restart_backoff_s: float = 10.0
    restart_backoff_max_s: float = 300.0

    @classmethod
    def from_config(cls, config: OperatorConfig) -> Settings:
        return cls(
            python=config.python,
            restart_backoff_s=config.restart_backoff_s,
            restart_backoff_max_s=config.restart_backoff_max_s,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The world as one pass observed it: the TrainerGroup, its RayCluster, pods, job, actors.

    Ray is read only when the Kubernetes side is ready (see :func:`decide.ray_reads`); what
    was not read keeps its default.
    """

    tg: TrainerGroup
    status: TrainerGroupStatus
    """The status the pass starts from (the last one written)."""
    now: datetime.datetime
    dashboard_url: str
    ray_address: str
    raycluster: Mapping[str, Any] | None = None
    pods: tuple[Mapping[str, Any], ...] = ()
    workload: Mapping[str, Any] | None = None
    """Kueue's Workload for a suspended RayCluster (None: not suspended, none, or no Kueue)."""
    priority_class_exists: bool | None = None
    """Whether the group's ``spec.queue.priorityClass`` exists as a Kueue WorkloadPriorityClass;
    read only for a suspended RayCluster with no Workload (None: not read, or unknown)."""
    claim: Mapping[str, Any] | None = None
    """The checkpoint claim (``rayCluster.storage.claimName``), read only while the RayCluster
    is to be created (None: not read, missing, or unreadable; tg_operator.claims)."""
    dashboard_error: str | None = None
    """The dashboard's ``/api/version`` failed (None: it answered, or it was not asked)."""
    alive_worker_nodes: int | None = None
    """Live worker nodes in Ray's node table (None: not read)."""
    job: JobInfo | None = None
    """The server job of the current group generation (None: not submitted, or not read)."""
    job_logs: str = ""
    """Its output, read once the job is terminal."""
    ray_error: str = ""
    """Reading the job from Ray failed."""
    actors: tuple[ActorInfo, ...] | None = None
    """The actors of the group's Ray namespace (None: not read, or unreadable)."""
    actors_error: str = ""
    training: TrainingProgress | None = None
    """Rank 0's last recorded optimizer step (None: none yet, or not read)."""
    training_error: str = ""
    """Reading rank 0's progress file failed (the status keeps the last progress)."""
    tinker: TinkerSeen | None = None
    """The group's Tinker server as the Deployment watch shows it (None: not looked at,
    e.g. ``spec.api.tinker`` is off)."""
    slot_free: bool = True
    """A Ray job slot is free for the server job (``TG_MAX_CONCURRENT_JOBS``)."""
    slots_in_flight: int = 0
    slot_limit: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinkerSeen:
    """The Tinker server's Deployment ``<name>-tinker`` (None: the watch shows none)."""

    deployment: Mapping[str, Any] | None = None
    just_created: bool = False
    """This process created the server's objects moments ago (``reconcile.TINKER_WATCH_GRACE``) and
    the watch does not show the Deployment yet: creating them again would only be answered
    "exists", and a Service create answered so has allocated a ClusterIP that the API server
    reclaims with a Warning event (IPAddressWrongReference, kind 2026-12-02 21:53)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RayReads:
    """Which Ray reads a snapshot needs (decided from its Kubernetes part)."""

    probe: bool = False
    job: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
    type: str
    reason: str
    message: str


# -- actions: the one thing a pass does besides writing the status -------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class CreateCluster:
    """Create the group's Secret and NetworkPolicy when missing, then its RayCluster."""

    body: dict[str, Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeleteCluster:
    """Delete the owned RayCluster (its spec changed; the next passes re-create it)."""

    name: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class SubmitServer:
    """Take a job slot and submit the server entrypoint under a deterministic id."""

    submission_id: str
    entrypoint: str
    metadata: dict[str, str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WaitForSlot:
    """Ask to be woken when a job slot on this Ray cluster frees."""

    submission_id: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StopServer:
    """Stop a server job that ran too long (one teardown step; errors are only logged)."""

    generation: int
    ray_namespace: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class TearDown:
    """One teardown step of the current group generation before it is re-created.

    Its outcome goes to :func:`tg_operator.recreate.after_teardown`, which decides the
    status to write.
    """

    generation: int
    reason: str
    dashboard_url: str
    ray_namespace: str
    restart: bool = False
    """A worker died (counts as a restart)."""
    fresh: bool = False
    """A spec change revives a Failed group: its restart budget starts over."""
    cluster_going: bool = False
    """The owned RayCluster is being rebuilt: an unreachable Ray need not be cleaned."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeTinker:
    """Create the Tinker server's objects that are missing (an existing one is left as it
    is): the keys Secret with a fresh random key, then ``bodies`` in order. ``update``: the
    Deployment exists but was built from another spec; ``bodies`` is its new version, whose
    pod template replaces the old one (the keys Secret and the other objects stay)."""

    secret_name: str
    bodies: tuple[dict[str, Any], ...]
    update: bool = False


Action = (
    ServeTinker
    | CreateCluster
    | DeleteCluster
    | SubmitServer
    | WaitForSlot
    | StopServer
    | TearDown
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What one pass does: at most one action, then the status write, then the events."""

    rule: str
    """The rule that decided (tests and logs name outcomes by it)."""
    status: TrainerGroupStatus
    step: Step
    action: Action | None = None
    events: tuple[Event, ...] = ()
    failure: str = ""
    """The reason, when the phase becomes Failed."""
    newly_dead: int = 0
    """Workers seen dead for the first time (a metric)."""
    restarted: bool = False
    """The group was re-created after a death (a metric)."""
