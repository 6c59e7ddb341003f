"""Which spec changes need a new worker group, and which need a new RayCluster.

The fields the workers are built from (workers, parallelism, model, optimizer,
training) are hashed into ``status.specHash``; the fields the RayCluster is built
from (image, rayVersion, rayCluster or rayClusterRef) into ``status.clusterHash``.
A change to either hash re-creates the group under a new group generation (a new
cluster also means new worker processes). Anything else (labels, annotations,
restartPolicy, maxRestarts, timeouts, training.stallSeconds) is applied without touching the
running workers.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

from tgapi import TrainerGroupSpec, TrainerGroupStatus, to_wire
from tgapi.hub import is_hub_id
from tgapi.model import PLACEMENT_AUTO, PodSecuritySpec, RayWorkerNodesSpec


class SpecChange(enum.Enum):
    NONE = "none"
    """Nothing the workers or the cluster depend on changed."""
    GROUP = "group"
    """The workers must be re-created on the same cluster."""
    CLUSTER = "cluster"
    """The RayCluster must be rebuilt (and the workers with it)."""


def _digest(value: Any) -> str:
    raw = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def group_hash(spec: TrainerGroupSpec) -> str:
    """Hash of the spec fields the worker group is built from."""
    return _digest(
        {
            "workers": _placement_as_before(to_wire(spec.workers)),
            "parallelism": to_wire(spec.parallelism),
            "model": to_wire(spec.model),
            "optimizer": to_wire(spec.optimizer),
            "training": _without_defaults(
                _without(to_wire(spec.training), NOT_HASHED_TRAINING), LATER_TRAINING_FIELDS
            ),
        }
    )


NOT_HASHED_TRAINING = frozenset({"stallSeconds"})
"""Training fields only the operator reads: a change never re-creates the workers (and the hash
of a group made before a field existed stays the same)."""


LATER_TRAINING_FIELDS: dict[str, Any] = {
    "microBatchTokens": 0,
    "keepCheckpoints": 0,
    "samplerWeightsMemory": "",
}
"""Training fields the workers read, added after groups were first hashed, with their defaults:
hashed only when set (a set value re-creates the workers; an operator upgrade does not)."""


def _without(wire: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in wire.items() if k not in keys}


def _placement_as_before(workers: dict[str, Any]) -> dict[str, Any]:
    """``placementStrategy: auto`` hashed as ``PACK``, the default before auto existed: an
    operator upgrade does not re-create running groups (their next re-creation uses auto)."""
    if workers.get("placementStrategy") == PLACEMENT_AUTO:
        return {**workers, "placementStrategy": "PACK"}
    return workers


LATER_CLUSTER_FIELDS: dict[str, Any] = {
    "schedulerName": "",
    "runtimeClassName": "",
    "podSecurity": to_wire(PodSecuritySpec()),
}
"""rayCluster fields added after clusters were first hashed, with their defaults: hashed only
when set, so that an operator upgrade does not replace the clusters already running."""

LATER_WORKER_POD_FIELDS: dict[str, Any] = {
    "cpuLimit": "",
    "shmSize": "",
    "capabilities": [],
    "extendedResources": [],
    "hostNetwork": False,
    "ncclSocketIfname": to_wire(RayWorkerNodesSpec()).get("ncclSocketIfname"),
    "volumes": [],
}
"""The same for ``rayCluster.workers``."""


def _without_defaults(wire: Any, defaults: dict[str, Any]) -> Any:
    if not isinstance(wire, dict):
        return wire
    return {k: v for k, v in wire.items() if k not in defaults or v != defaults[k]}


OLD_WORKER_MEMORY = "32Gi"
"""``rayCluster.workers.memory``'s default before it scaled with the pod's GPUs (empty now)."""


def _cluster_wire(wire: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = _without_defaults(wire, LATER_CLUSTER_FIELDS)
    workers = out.get("workers")
    if isinstance(workers, dict):
        workers = _without_defaults(workers, LATER_WORKER_POD_FIELDS)
        if workers.get("memory") == "":  # hashed as the old default: no re-creation on upgrade
            workers["memory"] = OLD_WORKER_MEMORY
        out["workers"] = workers
    return out


def cluster_hash(spec: TrainerGroupSpec) -> str:
    """Hash of the spec fields the RayCluster is built from."""
    if spec.ray_cluster_ref is not None:
        return _digest({"rayClusterRef": spec.ray_cluster_ref.name})
    fields: dict[str, Any] = {
        "image": spec.image,
        "rayVersion": spec.ray_version,
        "rayCluster": _cluster_wire(to_wire(spec.ray_cluster)),
    }
    if spec.queue is not None:
        fields["queue"] = to_wire(spec.queue)
    if spec.model.pretrained is not None and spec.ray_cluster is not None:
        fields["headReadsCheckpoints"] = (  # head mount (platform.head_reads_checkpoints)
            spec.ray_cluster.storage is not None and not is_hub_id(spec.model.pretrained)
        )
    if spec.model.hub_token_secret:  # HF_TOKEN in every Ray pod (pods.hub_token_env)
        fields["hubTokenSecret"] = spec.model.hub_token_secret
    return _digest(fields)


def classify(status: TrainerGroupStatus, spec: TrainerGroupSpec) -> SpecChange:
    """What the running group (as recorded in ``status``) needs after a spec change."""
    if not status.submission_id:
        return SpecChange.NONE  # nothing started for this generation: nothing to re-create
    if status.cluster_hash and status.cluster_hash != cluster_hash(spec):
        return SpecChange.CLUSTER
    if status.spec_hash and status.spec_hash != group_hash(spec):
        return SpecChange.GROUP
    return SpecChange.NONE
