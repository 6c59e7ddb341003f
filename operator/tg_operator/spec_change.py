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
            "workers": to_wire(spec.workers),
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


LATER_TRAINING_FIELDS: dict[str, Any] = {"microBatchTokens": 0}
"""Training fields the workers read, added after groups were first hashed, with their defaults:
hashed only when set (a set value re-creates the workers; an operator upgrade does not)."""


def _without(wire: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    return {k: v for k, v in wire.items() if k not in keys}


LATER_CLUSTER_FIELDS: dict[str, Any] = {"schedulerName": ""}
"""rayCluster fields added after clusters were first hashed, with their defaults: hashed only
when set, so that an operator upgrade does not replace the clusters already running."""


def _without_defaults(wire: Any, defaults: dict[str, Any]) -> Any:
    if not isinstance(wire, dict):
        return wire
    return {k: v for k, v in wire.items() if k not in defaults or v != defaults[k]}


def cluster_hash(spec: TrainerGroupSpec) -> str:
    """Hash of the spec fields the RayCluster is built from."""
    if spec.ray_cluster_ref is not None:
        return _digest({"rayClusterRef": spec.ray_cluster_ref.name})
    fields: dict[str, Any] = {
        "image": spec.image,
        "rayVersion": spec.ray_version,
        "rayCluster": _without_defaults(to_wire(spec.ray_cluster), LATER_CLUSTER_FIELDS),
    }
    if spec.queue is not None:
        fields["queue"] = to_wire(spec.queue)
    if spec.model.pretrained is not None and spec.ray_cluster is not None:
        fields["headReadsCheckpoints"] = spec.ray_cluster.storage is not None  # head mount
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
