"""The RayCluster manifest a TrainerGroup gets."""

from __future__ import annotations

from typing import Any

from tests.operator.helpers import BASE_SPEC, trainergroup
from tg_operator import names, owners, raycluster
from tg_operator.raycluster import GPU_RESOURCE, build_raycluster


def _spec_with(**workers: object) -> dict[str, object]:
    spec = {**BASE_SPEC, "rayCluster": {**BASE_SPEC["rayCluster"]}}
    spec["rayCluster"]["workers"] = {**BASE_SPEC["rayCluster"]["workers"], **workers}
    return spec


def test_head_has_no_gpus_and_zero_cpus_for_ray() -> None:
    rc = build_raycluster(trainergroup(), cluster_hash="h")
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    c = head["template"]["spec"]["containers"][0]
    assert GPU_RESOURCE not in c["resources"]["limits"]
    assert GPU_RESOURCE not in c["resources"]["requests"]
    assert c["resources"] == {  # the CPU requested, not limited
        "limits": {"memory": "2Gi"},
        "requests": {"cpu": "1", "memory": "2Gi"},
    }
    assert c["image"] == "ghcr.io/trainergroup/runtime:0.1.0"
    assert {p["containerPort"] for p in c["ports"]} >= {6379, 8265}
    assert "tolerations" not in head["template"]["spec"]


def test_workers_get_gpu_limits_requests_and_the_gpu_toleration() -> None:
    rc = build_raycluster(trainergroup(), cluster_hash="h")
    (group,) = rc["spec"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
    pod = group["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"][GPU_RESOURCE] == "2"
    assert c["resources"]["requests"][GPU_RESOURCE] == "2"
    assert c["resources"]["requests"]["cpu"] == "2"
    assert "cpu" not in c["resources"]["limits"]
    assert c["image"] == "ghcr.io/trainergroup/runtime:0.1.0"
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_cpu_only_workers_get_neither_gpus_nor_the_toleration() -> None:
    tg = trainergroup(spec=_spec_with(gpusPerWorker=0))
    rc = build_raycluster(tg, cluster_hash="h")
    pod = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert GPU_RESOURCE not in pod["containers"][0]["resources"]["limits"]
    assert pod["tolerations"] == []


def test_user_tolerations_node_selector_and_env_are_kept() -> None:
    mine = {"key": GPU_RESOURCE, "operator": "Equal", "value": "present", "effect": "NoSchedule"}
    other = {"key": "dedicated", "operator": "Exists"}
    tg = trainergroup(
        spec=_spec_with(
            tolerations=[mine, other],
            nodeSelector={"gpu": "h200"},
            env=[{"name": "NCCL_DEBUG", "value": "INFO"}],
        )
    )
    pod = build_raycluster(tg, cluster_hash="h")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["tolerations"] == [mine, other]  # no duplicate GPU toleration
    assert pod["nodeSelector"] == {"gpu": "h200"}
    assert pod["containers"][0]["env"][-1] == {"name": "NCCL_DEBUG", "value": "INFO"}


def test_owned_labelled_named_and_hashed() -> None:
    tg = trainergroup()
    rc = build_raycluster(tg, cluster_hash="abc")
    meta = rc["metadata"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert meta["name"] == "demo" and meta["namespace"] == "team-a"
    assert meta["labels"][names.NAME_LABEL] == "demo"
    assert meta["annotations"][names.CLUSTER_HASH_ANNOTATION] == "abc"
    (ref,) = meta["ownerReferences"]
    assert ref == {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "name": "demo",
        "uid": tg.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert owners.is_owned_by(rc, tg)
    assert rc["spec"]["rayVersion"] == "2.60.0"
    assert raycluster.desired_worker_replicas(rc) == 1


def test_cluster_ref_is_not_built() -> None:
    spec = {k: v for k, v in BASE_SPEC.items() if k != "rayCluster"}
    tg = trainergroup(spec={**spec, "rayClusterRef": {"name": "shared"}})
    assert names.cluster_name(tg) == "shared"
    assert not names.owns_cluster(tg)
    try:
        build_raycluster(tg, cluster_hash="h")
    except ValueError as exc:
        assert "rayClusterRef" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected ValueError")


# -- what a platform sets (tg_operator.platform) ---------------------------------------------
def _cluster_with(**fields: Any) -> dict[str, Any]:
    return {**BASE_SPEC, "rayCluster": {**BASE_SPEC["rayCluster"], **fields}}


def _pods(rc: dict[str, Any]) -> list[dict[str, Any]]:
    """The head's and the worker group's pod templates."""
    spec = rc["spec"]
    return [spec["headGroupSpec"]["template"], spec["workerGroupSpecs"][0]["template"]]


def test_checkpoint_claim_is_mounted_on_every_worker_and_not_on_the_head() -> None:
    tg = trainergroup(
        spec={
            **_cluster_with(storage={"claimName": "ckpt", "mountPath": "/mnt/ckpt"}),
            "training": {**BASE_SPEC["training"], "checkpointDir": "/mnt/ckpt/demo"},
        }
    )
    head, worker = _pods(build_raycluster(tg, cluster_hash="h"))
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in worker[
        "spec"
    ]["volumes"]
    (c,) = worker["spec"]["containers"]
    assert {"name": "checkpoints", "mountPath": "/mnt/ckpt"} in c["volumeMounts"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert "volumes" not in head["spec"]


def test_no_storage_means_only_the_shared_memory_volume() -> None:
    _, worker = _pods(build_raycluster(trainergroup(), cluster_hash="h"))
    assert [v["name"] for v in worker["spec"]["volumes"]] == ["dshm"]
    assert [m["name"] for m in worker["spec"]["containers"][0]["volumeMounts"]] == ["dshm"]


def test_identity_fields_go_on_every_pod_and_are_absent_by_default() -> None:
    tg = trainergroup(
        spec=_cluster_with(
            serviceAccountName="trainer",
            imagePullSecrets=["regcred", "mirror"],
            priorityClassName="training-high",
        )
    )
    for pod in _pods(build_raycluster(tg, cluster_hash="h")):
        assert pod["spec"]["serviceAccountName"] == "trainer"
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
        assert pod["spec"]["priorityClassName"] == "training-high"
    for pod in _pods(build_raycluster(trainergroup(), cluster_hash="h")):
        for key in ("serviceAccountName", "imagePullSecrets", "priorityClassName"):
            assert key not in pod["spec"]


def test_labels_and_annotations_keep_the_operators_own_keys() -> None:
    tg = trainergroup(
        spec=_cluster_with(
            labels={"team": "llm", names.NAME_LABEL: "spoofed"},
            annotations={"cost-center": "42", names.CLUSTER_HASH_ANNOTATION: "spoofed"},
            podLabels={"sidecar.istio.io/inject": "false", names.NAME_LABEL: "spoofed"},
            podAnnotations={"prometheus.io/scrape": "true"},
        )
    )
    rc = build_raycluster(tg, cluster_hash="abc")
    assert rc["metadata"]["labels"]["team"] == "llm"
    assert rc["metadata"]["labels"][names.NAME_LABEL] == "demo"
    assert rc["metadata"]["annotations"] == {
        "cost-center": "42",
        names.CLUSTER_HASH_ANNOTATION: "abc",
    }
    for pod in _pods(rc):
        assert pod["metadata"]["labels"]["sidecar.istio.io/inject"] == "false"
        assert pod["metadata"]["labels"][names.NAME_LABEL] == "demo"
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
    assert "team" not in _pods(rc)[0]["metadata"]["labels"]  # cluster labels stay on the cluster
    for pod in _pods(build_raycluster(trainergroup(), cluster_hash="h")):
        assert "annotations" not in pod["metadata"]


def test_head_resources_and_placement() -> None:
    toleration = {"key": "cpu-pool", "operator": "Exists", "effect": "NoSchedule"}
    tg = trainergroup(
        spec=_cluster_with(
            head={"cpu": "500m", "memory": "3Gi", "nodeSelector": {"pool": "cpu"},
                  "tolerations": [toleration]}
        )
    )
    head, worker = _pods(build_raycluster(tg, cluster_hash="h"))
    (c,) = head["spec"]["containers"]
    assert c["resources"] == {
        "limits": {"memory": "3Gi"},
        "requests": {"cpu": "500m", "memory": "3Gi"},
    }
    assert head["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert head["spec"]["tolerations"] == [toleration]
    assert "nodeSelector" not in worker["spec"]  # the head's placement is its own
    assert toleration not in worker["spec"]["tolerations"]
