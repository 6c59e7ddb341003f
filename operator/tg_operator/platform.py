"""What a platform sets on a TrainerGroup's RayCluster and its pods (pure functions).

``raycluster.py`` builds the cluster; these functions hold the platform's part of it,
each from one field group of ``spec.rayCluster``:

* :func:`cluster_metadata`: the RayCluster's labels and annotations (``labels``,
  ``annotations``); the operator's own keys win over the user's.
* :func:`pod_metadata`: the head and worker pod templates' labels and annotations
  (``podLabels``, ``podAnnotations``); the operator's labels win, since it selects pods by
  them.
* :func:`pod_identity`: ``serviceAccountName``, ``imagePullSecrets``, ``priorityClassName``,
  ``schedulerName`` and ``runtimeClassName`` of every Ray pod.
* :func:`head_placement`: the head pod's ``nodeSelector`` and ``tolerations``.
* :func:`checkpoint_volume` / :func:`checkpoint_mount`: the checkpoint claim
  (``storage``) as a volume and a mount, on every worker pod.
* :func:`extra_volumes` / :func:`extra_mounts`: ``rayCluster.workers.volumes``.

The claim is the platform's: named, never created or deleted by the operator, so deleting
a TrainerGroup never deletes checkpoints (and the operator needs no rights on claims).
"""

from __future__ import annotations

from typing import Any

from tgapi import TrainerGroup
from tgapi.hub import is_hub_id
from tgapi.model import CheckpointStorageSpec, RayClusterSpec

CHECKPOINT_VOLUME = "checkpoints"
"""Name of the checkpoint volume in worker pods."""


def _cluster_spec(tg: TrainerGroup) -> RayClusterSpec:
    rc = tg.spec.ray_cluster
    if rc is None:
        raise ValueError(f"TrainerGroup {tg.namespace}/{tg.name} uses rayClusterRef")
    return rc


def cluster_metadata(
    tg: TrainerGroup, *, labels: dict[str, str], annotations: dict[str, str]
) -> dict[str, dict[str, str]]:
    """The RayCluster's ``labels`` and ``annotations``: the user's, then the operator's."""
    rc = _cluster_spec(tg)
    return {
        "labels": {**rc.labels, **labels},
        "annotations": {**rc.annotations, **annotations},
    }


def pod_metadata(tg: TrainerGroup, *, labels: dict[str, str]) -> dict[str, Any]:
    """A pod template's ``metadata``: the user's pod labels under the operator's, and the
    user's pod annotations (omitted when there are none)."""
    rc = _cluster_spec(tg)
    meta: dict[str, Any] = {"labels": {**rc.pod_labels, **labels}}
    if rc.pod_annotations:
        meta["annotations"] = dict(rc.pod_annotations)
    return meta


def pod_identity(tg: TrainerGroup) -> dict[str, Any]:
    """Pod spec fields every pod gets: only those the spec sets."""
    rc = _cluster_spec(tg)
    out: dict[str, Any] = {}
    if rc.service_account_name:
        out["serviceAccountName"] = rc.service_account_name
    if rc.image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in rc.image_pull_secrets]
    if rc.priority_class_name:
        out["priorityClassName"] = rc.priority_class_name
    if rc.scheduler_name:
        out["schedulerName"] = rc.scheduler_name
    if rc.runtime_class_name:
        out["runtimeClassName"] = rc.runtime_class_name
    return out


def head_placement(tg: TrainerGroup) -> dict[str, Any]:
    """The head pod's ``nodeSelector`` and ``tolerations``, where set."""
    head = _cluster_spec(tg).head
    out: dict[str, Any] = {}
    if head.node_selector:
        out["nodeSelector"] = dict(head.node_selector)
    if head.tolerations:
        out["tolerations"] = [dict(t) for t in head.tolerations]
    return out


def _storage(tg: TrainerGroup) -> CheckpointStorageSpec | None:
    """``rayCluster.storage``; None without it, and for a group on a ``rayClusterRef`` (the
    referenced cluster's volumes are not the operator's to know: the Tinker server of such a
    group mounts no claim)."""
    rc = tg.spec.ray_cluster
    return None if rc is None else rc.storage


def checkpoint_volume(tg: TrainerGroup) -> list[dict[str, Any]]:
    """The worker pods' checkpoint volume (none without ``storage``)."""
    storage = _storage(tg)
    if storage is None:
        return []
    return [
        {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": storage.claim_name}}
    ]


def checkpoint_mount(tg: TrainerGroup) -> list[dict[str, Any]]:
    """The worker container's mount of the checkpoint volume (none without ``storage``)."""
    storage = _storage(tg)
    if storage is None:
        return []
    return [{"name": CHECKPOINT_VOLUME, "mountPath": storage.mount_path}]


def head_reads_checkpoints(tg: TrainerGroup) -> bool:
    """Whether the head pod mounts the checkpoint claim too (read-only): when
    ``model.pretrained`` is set, the server job parses the spec on the head and reads the
    checkpoint's config.json there (tgapi.pretrained)."""
    rc = tg.spec.ray_cluster
    pretrained = tg.spec.model.pretrained
    return (rc is not None and rc.storage is not None and pretrained is not None
            and not is_hub_id(pretrained))  # a hub id is downloaded, not read from the volume


def head_checkpoint_mount(tg: TrainerGroup) -> list[dict[str, Any]]:
    if not head_reads_checkpoints(tg):
        return []
    return [{**mount, "readOnly": True} for mount in checkpoint_mount(tg)]


def head_checkpoint_volume(tg: TrainerGroup) -> list[dict[str, Any]]:
    return checkpoint_volume(tg) if head_reads_checkpoints(tg) else []


def extra_volumes(tg: TrainerGroup) -> list[dict[str, Any]]:
    """``rayCluster.workers.volumes`` as the worker pods' volumes (their sources as written)."""
    return [{**dict(v.source), "name": v.name} for v in _cluster_spec(tg).workers.volumes]


def extra_mounts(tg: TrainerGroup) -> list[dict[str, Any]]:
    """The worker container's mounts of ``rayCluster.workers.volumes``."""
    out: list[dict[str, Any]] = []
    for v in _cluster_spec(tg).workers.volumes:
        mount: dict[str, Any] = {"name": v.name, "mountPath": v.mount_path}
        if v.read_only:
            mount["readOnly"] = True
        out.append(mount)
    return out
