"""Which spec changes need a new worker group, and which need a new RayCluster.

The fields the workers are built from (workers, parallelism, model, optimizer,
training) are hashed into ``status.specHash``; the fields the RayCluster is built
from (image, rayVersion, rayCluster or rayClusterRef) into ``status.clusterHash``.
A change to either hash re-creates the group under a new group generation (a new
cluster also means new worker processes). Anything else (labels, annotations,
restartPolicy, maxRestarts, timeouts) is applied without touching the running workers.
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
            "training": to_wire(spec.training),
        }
    )


def cluster_hash(spec: TrainerGroupSpec) -> str:
    """Hash of the spec fields the RayCluster is built from."""
    if spec.ray_cluster_ref is not None:
        return _digest({"rayClusterRef": spec.ray_cluster_ref.name})
    fields = {
        "image": spec.image,
        "rayVersion": spec.ray_version,
        "rayCluster": to_wire(spec.ray_cluster),
    }
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
