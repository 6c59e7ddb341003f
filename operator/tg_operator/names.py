"""Names, labels and annotations the operator owns (see docs/contracts.md).

Everything the operator creates is named deterministically from the TrainerGroup, so
a restarted operator finds what it created before instead of creating it twice.
"""

from __future__ import annotations

from tgapi import API_GROUP, API_VERSION, KIND, PLURAL, TrainerGroup

GROUP = API_GROUP
VERSION = API_VERSION
TG_KIND = KIND
TG_PLURAL = PLURAL
TG_API_VERSION = f"{API_GROUP}/{API_VERSION}"

FINALIZER = "trainergroup.io/finalizer"
STORAGE_PREFIX = "kopf.trainergroup.io"
RECONCILE_HANDLER = "reconcile"
"""The id of the create/update/resume handler (kopf keeps its progress under this key)."""
FORCE_DELETE_ANNOTATION = "trainergroup.io/force-delete"
CLUSTER_HASH_ANNOTATION = "trainergroup.io/cluster-hash"

NAME_LABEL = "trainergroup.io/name"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "trainergroup-operator"

RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAY_PLURAL = "rayclusters"
RAY_KIND = "RayCluster"
RAY_CLUSTER_LABEL = "ray.io/cluster"
RAY_NODE_TYPE_LABEL = "ray.io/node-type"

# Ray job metadata keys: who submitted a job, so a job is never mistaken for another's.
JOB_META_UID = "trainergroup.io/uid"
JOB_META_NAME = "trainergroup.io/name"
JOB_META_NAMESPACE = "trainergroup.io/namespace"
JOB_META_GENERATION = "trainergroup.io/group-generation"

SERVER_MODULE = "tgruntime.entrypoints.server"
TEARDOWN_MODULE = "tgruntime.entrypoints.teardown"


def job_prefix(*, namespace: str, name: str, uid: str) -> str:
    """Start of every Ray job id of one object; 8 characters of its uid make sure a
    re-created object (same name) never adopts its predecessor's jobs."""
    return f"tg-{namespace}-{name}-{(uid.replace('-', '') or 'nouid')[:8]}-"


def server_submission_id(tg: TrainerGroup, *, generation: int) -> str:
    return f"{job_prefix(namespace=tg.namespace, name=tg.name, uid=tg.uid)}g{generation}"


def teardown_submission_id(tg: TrainerGroup, *, generation: int, attempt: int) -> str:
    prefix = job_prefix(namespace=tg.namespace, name=tg.name, uid=tg.uid)
    return f"{prefix}teardown-g{generation}-{attempt}"


def cluster_name(tg: TrainerGroup) -> str:
    """The RayCluster the group runs on: the referenced one, or one named like the group."""
    ref = tg.spec.ray_cluster_ref
    return str(ref.name) if ref is not None else tg.name


def owns_cluster(tg: TrainerGroup) -> bool:
    return tg.spec.ray_cluster_ref is None


def labels(tg: TrainerGroup) -> dict[str, str]:
    return {NAME_LABEL: tg.name, MANAGED_BY_LABEL: MANAGED_BY}
