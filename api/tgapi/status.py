"""The TrainerGroup status: phases, conditions and the client contract.

``workerNames`` + ``rayNamespace`` + ``rayAddress`` (+ ``groupName``) is what a
client needs to attach. The operator writes this shape; clients read it with
:func:`parse_status`. The CRD's status schema is generated from these classes, so a
field that is not declared here would be pruned by the API server.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Mapping
from typing import Any

from tgapi.fields import field_meta, has_default, spec_field

QUEUED = "Queued"
"""The phase of a group whose RayCluster waits for Kueue's admission (``spec.queue``)."""
PHASES = (
    "Pending",
    QUEUED,
    "ClusterProvisioning",
    "WorkersStarting",
    "Ready",
    "Degraded",
    "Failed",
    "Terminating",
)
CONDITION_TYPES = ("RayClusterReady", "WorkersReady", "Degraded", "Training")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Condition:
    type: str = spec_field(name="type", description="Condition type.")
    status: str = spec_field(
        name="status", description="True, False or Unknown.", enum=("True", "False", "Unknown")
    )
    reason: str = spec_field(name="reason", description="CamelCase reason.", default="")
    message: str = spec_field(name="message", description="Human-readable message.", default="")
    last_transition_time: str = spec_field(
        name="lastTransitionTime",
        description="When the status last changed (RFC 3339).",
        default="",
    )
    observed_generation: int = spec_field(
        name="observedGeneration",
        description="Spec generation this condition was computed for.",
        default=0,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    name: str = spec_field(name="name", description="Ray actor name.")
    rank: int = spec_field(name="rank", description="Global rank.")
    state: str = spec_field(
        name="state", description="Ray actor state (ALIVE, DEAD, ...).", default="UNKNOWN"
    )
    node: str = spec_field(name="node", description="Ray node id or IP.", default="")
    pid: int = spec_field(name="pid", description="Worker process id.", default=0)
    cause: str = spec_field(name="cause", description="Why the worker died, if it did.", default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshStatus:
    tp: int = spec_field(name="tp", description="Tensor parallel size.", default=1)
    pp: int = spec_field(name="pp", description="Pipeline parallel size.", default=1)
    cp: int = spec_field(name="cp", description="Context parallel size.", default=1)
    dp: int = spec_field(name="dp", description="Data parallel size.", default=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunStatus:
    """One training run of a LoRA group."""

    id: str = spec_field(name="id", description="The run (the Tinker model id).", default="")
    steps: int = spec_field(name="steps", description="Optimizer steps it took.", default=0)
    last_activity_time: str = spec_field(
        name="lastActivityTime",
        description="When it last trained, sampled or saved (RFC 3339).",
        default="",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingStatus:
    """The group's last optimizer step, as its rank 0 recorded it (tgapi.progress)."""

    step: int = spec_field(
        name="step", description="Optimizer steps taken (continues across a resume).", default=0
    )
    loss: float | None = spec_field(
        name="loss", description="Mean loss of the last step (absent: not finite).", default=None
    )
    grad_norm: float | None = spec_field(
        name="gradNorm",
        description="Gradient norm of the last step, before clipping.",
        default=None,
    )
    tokens_per_second: float | None = spec_field(
        name="tokensPerSecond",
        description="Tokens of the global batch per second of the step.",
        default=None,
    )
    last_step_time: str = spec_field(
        name="lastStepTime", description="When the last step ended (RFC 3339).", default=""
    )
    runs: int = spec_field(name="runs", description="Training runs in the group.", default=1)
    run_list: list[RunStatus] = spec_field(
        name="runList",
        description="A LoRA group's runs, the most recently active first (at most 32).",
        default_factory=list,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerGroupStatus:
    phase: str = spec_field(
        name="phase", description="Lifecycle phase.", default="Pending", enum=PHASES
    )
    message: str = spec_field(
        name="message", description="Last human-readable status message.", default=""
    )
    conditions: list[Condition] = spec_field(
        name="conditions", description="Conditions.", default_factory=list
    )
    observed_generation: int = spec_field(
        name="observedGeneration", description="Last spec generation acted on.", default=0
    )
    ray_cluster_name: str = spec_field(
        name="rayClusterName", description="The RayCluster in use.", default=""
    )
    ray_address: str = spec_field(
        name="rayAddress", description="GCS address host:port for Ray drivers.", default=""
    )
    dashboard_url: str = spec_field(
        name="dashboardURL", description="Ray dashboard URL.", default=""
    )
    ray_namespace: str = spec_field(
        name="rayNamespace", description="Ray namespace of the group.", default=""
    )
    group_name: str = spec_field(
        name="groupName", description="Group lookup name in the Ray namespace.", default=""
    )
    worker_names: list[str] = spec_field(
        name="workerNames", description="Worker actor names in rank order.", default_factory=list
    )
    workers: list[WorkerStatus] = spec_field(
        name="workers", description="Per-worker state.", default_factory=list
    )
    world_size: int = spec_field(name="worldSize", description="Number of workers.", default=0)
    ready_workers: int = spec_field(name="readyWorkers", description="Workers ALIVE.", default=0)
    mesh: MeshStatus | None = spec_field(name="mesh", description="Parallel mesh.", default=None)
    restarts: int = spec_field(
        name="restarts", description="Group re-creations after failures.", default=0
    )
    last_restart_time: str = spec_field(
        name="lastRestartTime", description="When the group was last re-created.", default=""
    )
    next_restart_time: str = spec_field(
        name="nextRestartTime",
        description="When the waiting re-creation runs (restart back-off); empty if none waits.",
        default="",
    )
    group_generation: int = spec_field(
        name="groupGeneration", description="Generation of the running group.", default=0
    )
    submission_id: str = spec_field(
        name="submissionId", description="Ray job that created the group.", default=""
    )
    spec_hash: str = spec_field(
        name="specHash", description="Hash of the spec fields the group was built from.", default=""
    )
    cluster_hash: str = spec_field(
        name="clusterHash",
        description="Hash of the spec fields the RayCluster was built from.",
        default="",
    )
    device: str = spec_field(
        name="device",
        description='What the workers run on: "cuda" or "cpu". Worker pods scheduled on GPU '
        'nodes whose containers see no CUDA (a fake-GPU test node) train on "cpu".',
        default="",
    )
    backend: str = spec_field(
        name="backend",
        description='The workers\' torch.distributed backend: "nccl" (GPU) or "gloo" (CPU).',
        default="",
    )
    api_url: str = spec_field(
        name="apiURL",
        description="Base URL of the group's Tinker API (TINKER_BASE_URL), "
        "http://<name>-tinker.<namespace>.svc:<port>, once its server is available; empty "
        "otherwise.",
        default="",
    )
    phase_since: str = spec_field(
        name="phaseSince",
        description="When the phase last changed (RFC 3339); timeouts count from here.",
        default="",
    )
    training: TrainingStatus | None = spec_field(
        name="training",
        description="Training progress: the last optimizer step (absent before the first).",
        default=None,
    )


log = logging.getLogger(__name__)
_warned: set[str] = set()

_COUNTERS = frozenset(
    {"observedGeneration", "worldSize", "readyWorkers", "restarts", "groupGeneration", "step"}
)
"""Counters the operator does arithmetic with: a negative one is garbage too."""


def _warn_once(path: str, problem: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning(
            "ignoring status.%s: %s (someone else wrote it; the default is used)", path, problem
        )


def parse_status(data: Any) -> TrainerGroupStatus:
    """Read a status mapping totally: unknown keys ignored, missing keys defaulted, and any
    value of the wrong type or outside its enum (written by someone other than the
    operator) replaced by its default with one logged warning per field; never raises."""
    if not isinstance(data, Mapping):
        if data is not None:
            _warn_once("(status)", f"not a mapping: {type(data).__name__}")
        data = {}
    status = _lenient(TrainerGroupStatus, data, "")
    assert isinstance(status, TrainerGroupStatus)
    return status


def _scalar_ok(tp: Any, value: Any) -> bool:
    if tp is int:
        return type(value) is int
    if tp is str:
        return isinstance(value, str)
    if tp is bool:
        return isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return False  # pragma: no cover - no other scalar types in the status model


def _lenient(cls: Any, data: Mapping[str, Any], prefix: str) -> Any:
    """``cls`` from ``data`` (see :func:`parse_status`); None when a required field of
    ``cls`` is missing or garbage (the caller drops that item)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = field_meta(f)
        wire, path = meta.name, f"{prefix}{meta.name}"
        raw = data.get(wire)
        value = _INVALID if raw is None else _value(hints[f.name], raw, path)
        if value is not _INVALID and meta.enum is not None and value not in meta.enum:
            _warn_once(path, f"{str(value)[:60]!r} is not one of {', '.join(meta.enum)}")
            value = _INVALID
        if value is not _INVALID and wire in _COUNTERS and value < 0:
            _warn_once(path, f"{value} is negative")
            value = _INVALID
        if value is _INVALID:
            if not has_default(f):
                return None
            continue
        values[f.name] = value
    return cls(**values)


_INVALID: Any = object()


def _value(tp: Any, raw: Any, path: str) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(raw, list):
            _warn_once(path, f"expected a list, got {type(raw).__name__}")
            return _INVALID
        items = []
        for i, item in enumerate(raw):
            got = _value(args[0], item, f"{path}[{i}]")
            if got is _INVALID or got is None:
                _warn_once(path, f"item {i} is not a valid {getattr(args[0], '__name__', '')}")
                continue
            items.append(got)
        return items
    inner = args[0] if len(args) == 1 else tp  # X | None: read as X
    if dataclasses.is_dataclass(inner):
        if not isinstance(raw, Mapping):
            _warn_once(path, f"expected a mapping, got {type(raw).__name__}")
            return _INVALID
        return _lenient(inner, raw, f"{path}.")
    if not _scalar_ok(inner, raw):
        _warn_once(path, f"expected {getattr(inner, '__name__', inner)}, got {type(raw).__name__}")
        return _INVALID
    return float(raw) if inner is float else raw
