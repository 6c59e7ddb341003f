"""Build the KubeRay ``RayCluster`` (ray.io/v1) a TrainerGroup runs on.

The head gets no GPUs and ``num-cpus: "0"`` so Ray never places a worker on it (it
still runs the job drivers: the server and teardown entrypoints). The one worker
group gets ``nvidia.com/gpu`` in both limits and requests, and a toleration for the
``nvidia.com/gpu`` taint is added automatically. Every Ray pod runs with the restricted Pod
Security Standard's settings, the CPU is requested but not limited, and ``/dev/shm`` has a
size limit (``pods.py``). The cluster is owned by the
TrainerGroup (garbage-collected with it) and labelled with its name. What a platform
adds (storage, service account, pull secrets, priority, labels and annotations, head
placement) comes from ``platform.py``.
"""

from __future__ import annotations

from typing import Any

from tg_operator import names, owners, platform, pods, probes, queue, ray_token
from tgapi import TrainerGroup

GPU_RESOURCE = pods.GPU_RESOURCE
WORKER_GROUP = "workers"
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"


def build_raycluster(tg: TrainerGroup, *, cluster_hash: str) -> dict[str, Any]:
    """The RayCluster manifest for ``tg`` (which must not use ``rayClusterRef``)."""
    rc = tg.spec.ray_cluster
    if rc is None:
        raise ValueError(f"TrainerGroup {tg.namespace}/{tg.name} uses rayClusterRef")
    labels = names.labels(tg)
    workers = rc.workers
    worker_pod: dict[str, Any] = {
        "containers": [
            {
                "name": WORKER_CONTAINER,
                "image": tg.spec.image,
                "resources": pods.worker_resources(workers),
                "env": pods.worker_env(tg),
                **probes.ray_node_probes(head=False),
                "volumeMounts": [
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    *platform.checkpoint_mount(tg),
                    *platform.extra_mounts(tg),
                ],
                "securityContext": pods.container_security(add=workers.capabilities),
            }
        ],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": pods.shm_size(workers)}},
            *platform.checkpoint_volume(tg),
            *platform.extra_volumes(tg),
        ],
        "tolerations": worker_tolerations(tg),
        "securityContext": pods.pod_security(
            rc.pod_security, mounts_claim=bool(platform.checkpoint_volume(tg))
        ),
        **platform.pod_identity(tg),
    }
    if workers.node_selector:
        worker_pod["nodeSelector"] = dict(workers.node_selector)
    if workers.host_network:
        worker_pod["hostNetwork"] = True
        worker_pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    manifest: dict[str, Any] = {
        "apiVersion": f"{names.RAY_GROUP}/{names.RAY_VERSION}",
        "kind": names.RAY_KIND,
        "metadata": {
            "name": names.cluster_name(tg),
            "namespace": tg.namespace,
            **platform.cluster_metadata(
                tg,
                labels=dict(labels),
                annotations={names.CLUSTER_HASH_ANNOTATION: cluster_hash},
            ),
            "ownerReferences": [owners.owner_reference(tg)],
        },
        "spec": {
            "rayVersion": tg.spec.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "serviceType": "ClusterIP",
                "rayStartParams": {
                    "dashboard-host": "0.0.0.0",
                    "num-cpus": "0",
                    "num-gpus": "0",
                },
                "template": {
                    "metadata": platform.pod_metadata(tg, labels=dict(labels)),
                    "spec": {
                        "containers": [
                            {
                                "name": HEAD_CONTAINER,
                                "image": tg.spec.image,
                                "resources": pods.head_resources(
                                    cpu=rc.head.cpu, memory=rc.head.memory
                                ),
                                "ports": [
                                    {"containerPort": 6379, "name": "gcs-server"},
                                    {"containerPort": 8265, "name": "dashboard"},
                                    {"containerPort": 10001, "name": "client"},
                                ],
                                **probes.ray_node_probes(head=True),
                                **_mounts(platform.head_checkpoint_mount(tg)),
                                "securityContext": pods.container_security(),
                            }
                        ],
                        **_volumes(platform.head_checkpoint_volume(tg)),
                        "securityContext": pods.pod_security(
                            rc.pod_security,
                            mounts_claim=bool(platform.head_checkpoint_volume(tg)),
                        ),
                        **platform.pod_identity(tg),
                        **platform.head_placement(tg),
                    },
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": WORKER_GROUP,
                    "replicas": rc.workers.replicas,
                    "minReplicas": rc.workers.replicas,
                    "maxReplicas": rc.workers.replicas,
                    "rayStartParams": {"num-cpus": pods.ray_cpus(workers)},
                    "template": {
                        "metadata": platform.pod_metadata(tg, labels=dict(labels)),
                        "spec": worker_pod,
                    },
                }
            ],
        },
    }
    add_token_auth(manifest, tg)
    add_gcs_fault_tolerance(manifest, tg)
    queue.add_to_cluster(manifest, tg)
    return manifest


def _mounts(mounts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"volumeMounts": mounts} if mounts else {}


def _volumes(volumes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"volumes": volumes} if volumes else {}


def ray_containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every container of the head and worker pod templates."""
    spec = manifest["spec"]
    templates = [spec["headGroupSpec"]["template"]] + [
        g["template"] for g in spec.get("workerGroupSpecs") or []
    ]
    return [c for t in templates for c in t["spec"]["containers"]]


def add_token_auth(manifest: dict[str, Any], tg: TrainerGroup) -> None:
    """Ray token authentication on every Ray container (``tg_operator.ray_token``): what
    KubeRay >= v1.5.1 does for ``authOptions: {mode: token}``, written out for v1.5.0; and
    the hub token (``pods.hub_token_env``), which every container that reads the spec needs."""
    for container in ray_containers(manifest):
        container["env"] = (
            ray_token.token_env(tg) + pods.hub_token_env(tg) + list(container.get("env") or [])
        )


def add_gcs_fault_tolerance(manifest: dict[str, Any], tg: TrainerGroup) -> None:
    """KubeRay's ``gcsFaultToleranceOptions`` when the spec asks for it: the GCS keeps its
    tables in the external Redis, so a new head pod finds the detached actors again."""
    rc = tg.spec.ray_cluster
    ft = rc.gcs_fault_tolerance if rc is not None else None
    if ft is None:
        return
    options: dict[str, Any] = {"redisAddress": ft.redis_address}
    if ft.redis_password_secret:
        options["redisPassword"] = {
            "valueFrom": {
                "secretKeyRef": {"name": ft.redis_password_secret, "key": "password"}
            }
        }
    manifest["spec"]["gcsFaultToleranceOptions"] = options


def worker_tolerations(tg: TrainerGroup) -> list[dict[str, Any]]:
    """The user's tolerations, plus one for the GPU taint when worker pods ask for GPUs."""
    rc = tg.spec.ray_cluster
    if rc is None:
        return []
    tolerations = [dict(t) for t in rc.workers.tolerations]
    if rc.workers.gpus_per_worker > 0 and not any(
        t.get("key") == GPU_RESOURCE for t in tolerations
    ):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def desired_worker_replicas(raycluster: dict[str, Any]) -> int:
    """Worker pods a RayCluster asks for (the sum over its worker groups)."""
    groups = raycluster.get("spec", {}).get("workerGroupSpecs") or []
    total = 0
    for g in groups:
        if g.get("suspend"):
            continue
        replicas = g.get("replicas")
        total += int(replicas if replicas is not None else g.get("minReplicas", 0) or 0)
    return total
