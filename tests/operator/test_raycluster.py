"""The RayCluster manifest a TrainerGroup gets."""

from __future__ import annotations

from tests.operator.helpers import BASE_SPEC, trainergroup
from tg_operator import names, raycluster
from tg_operator.raycluster import GPU_RESOURCE, build_raycluster


def _spec_with(**workers: object) -> dict[str, object]:
    spec = {**BASE_SPEC, "rayCluster": {**BASE_SPEC["rayCluster"]}}
    spec["rayCluster"]["workers"] = {**BASE_SPEC["rayCluster"]["workers"], **workers}  # type: ignore[index]
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
    assert c["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}
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
    assert c["resources"]["limits"]["cpu"] == "2"
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
    assert raycluster.is_owned_by(rc, tg)
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
