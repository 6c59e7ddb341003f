"""What every pod the operator builds gets (issue 36): the restricted Pod Security Standard,
runtimeClassName, requests without a CPU limit, a sized /dev/shm, NCCL/torch env defaults, and
the workers' opt-in RDMA capabilities, extended resources, hostNetwork and extra volumes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.operator.helpers import BASE_SPEC, trainergroup
from tg_operator import pods, tinker
from tg_operator.raycluster import build_raycluster
from tgapi import SpecErrors, TrainerGroup

RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _tg(*, cluster: dict[str, Any] | None = None, pod: dict[str, Any] | None = None,
        **sections: Any) -> TrainerGroup:
    """BASE_SPEC with ``cluster`` merged into rayCluster, ``pod`` into rayCluster.workers and
    each other section into the spec's section of that name."""
    spec = copy.deepcopy(BASE_SPEC)
    spec["rayCluster"].update(cluster or {})
    spec["rayCluster"]["workers"].update(pod or {})
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return trainergroup(spec=spec)


def _ray_pods(tg: TrainerGroup) -> tuple[dict[str, Any], dict[str, Any]]:
    """The head's and the worker group's pod specs."""
    rc = build_raycluster(tg, cluster_hash="h")
    return (
        rc["spec"]["headGroupSpec"]["template"]["spec"],
        rc["spec"]["workerGroupSpecs"][0]["template"]["spec"],
    )


def _tinker_pod(tg: TrainerGroup) -> dict[str, Any]:
    pod: dict[str, Any] = tinker.build_deployment(tg, python="python")["spec"]["template"]["spec"]
    return pod


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


STORAGE = {"storage": {"claimName": "ckpt", "mountPath": "/ckpt"}}


# -- restricted Pod Security Standard ------------------------------------------------------
def test_every_container_of_every_pod_is_restricted() -> None:
    tg = _tg()
    head, worker = _ray_pods(tg)
    for pod in (head, worker, _tinker_pod(tg)):
        for c in pod["containers"]:
            assert c["securityContext"] == RESTRICTED_CONTAINER, c["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_pods_run_as_the_runtime_images_user_by_default_and_the_specs_when_set() -> None:
    for pod in (*_ray_pods(_tg()), _tinker_pod(_tg())):
        assert pod["securityContext"]["runAsUser"] == 1000
        assert pod["securityContext"]["runAsGroup"] == 100
    tg = _tg(cluster={"podSecurity": {"runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 4000},
                      **STORAGE}, training={"checkpointDir": "/ckpt/run"})
    for pod in (*_ray_pods(tg)[1:], _tinker_pod(tg)):
        assert pod["securityContext"]["runAsUser"] == 2000
        assert pod["securityContext"]["runAsGroup"] == 3000
        assert pod["securityContext"]["fsGroup"] == 4000


def test_root_is_refused() -> None:
    with pytest.raises(SpecErrors, match=r"spec\.rayCluster\.podSecurity\.runAsUser"):
        _tg(cluster={"podSecurity": {"runAsUser": 0}})


def test_fs_group_on_every_pod_that_mounts_the_claim_and_only_there() -> None:
    tg = _tg(cluster=STORAGE, training={"checkpointDir": "/ckpt/run"})
    head, worker = _ray_pods(tg)
    for pod in (worker, _tinker_pod(tg)):
        assert pod["securityContext"]["fsGroup"] == 100
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    assert "fsGroup" not in head["securityContext"]  # the head mounts no claim
    # with model.pretrained the head reads the claim too
    tg = _tg(cluster=STORAGE, training={"checkpointDir": "/ckpt/run"},
             model={"pretrained": "/ckpt/llama", "positionEmbedding": "rope"})
    head, _ = _ray_pods(tg)
    assert head["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    # no claim, no fsGroup
    for pod in (*_ray_pods(_tg()), _tinker_pod(_tg())):
        assert "fsGroup" not in pod["securityContext"]
        assert "fsGroupChangePolicy" not in pod["securityContext"]


def test_rdma_capabilities_are_added_on_worker_containers_only() -> None:
    tg = _tg(pod={"capabilities": ["IPC_LOCK", "SYS_RESOURCE"]})
    head, worker = _ray_pods(tg)
    assert worker["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["IPC_LOCK", "SYS_RESOURCE"]
    }
    assert head["containers"][0]["securityContext"] == RESTRICTED_CONTAINER


@pytest.mark.parametrize("capability", ["SYS_ADMIN", "NET_ADMIN", "ALL", "ipc_lock"])
def test_capabilities_outside_the_rdma_list_are_refused(capability: str) -> None:
    with pytest.raises(SpecErrors, match=r"spec\.rayCluster\.workers\.capabilities\[0\]"):
        _tg(pod={"capabilities": [capability]})


# -- runtimeClassName ----------------------------------------------------------------------
def test_runtime_class_name_goes_on_every_ray_pod_and_is_absent_by_default() -> None:
    for pod in _ray_pods(_tg(cluster={"runtimeClassName": "nvidia"})):
        assert pod["runtimeClassName"] == "nvidia"
    for pod in _ray_pods(_tg()):
        assert "runtimeClassName" not in pod


def test_runtime_class_name_must_be_a_dns_name() -> None:
    with pytest.raises(SpecErrors, match=r"spec\.rayCluster\.runtimeClassName"):
        _tg(cluster={"runtimeClassName": "Nvidia_GPU"})


# -- sizing ------------------------------------------------------------------------------
def test_no_cpu_limit_by_default_on_ray_pods() -> None:
    head, worker = _ray_pods(_tg())
    for pod in (head, worker):
        resources = pod["containers"][0]["resources"]
        assert "cpu" in resources["requests"]
        assert "cpu" not in resources["limits"]
        assert resources["limits"]["memory"] == resources["requests"]["memory"]


@pytest.mark.parametrize(("cpu", "num_cpus"), [("8", "8"), ("500m", "1"), ("2.5", "3")])
def test_ray_counts_the_cpu_request_not_the_nodes_cpus(cpu: str, num_cpus: str) -> None:
    rc = build_raycluster(_tg(pod={"cpu": cpu}), cluster_hash="h")
    assert rc["spec"]["workerGroupSpecs"][0]["rayStartParams"] == {"num-cpus": num_cpus}


def test_cpu_limit_when_set() -> None:
    _, worker = _ray_pods(_tg(pod={"cpuLimit": "16"}))
    resources = worker["containers"][0]["resources"]
    assert resources["limits"]["cpu"] == "16"
    assert resources["requests"]["cpu"] == "2"


def _shm(tg: TrainerGroup) -> dict[str, Any]:
    _, worker = _ray_pods(tg)
    (dshm,) = [v for v in worker["volumes"] if v["name"] == "dshm"]
    return dict(dshm["emptyDir"])


@pytest.mark.parametrize(
    ("workers", "size"),
    [
        ({"gpusPerWorker": 0, "memory": "32Gi"}, "2Gi"),  # no GPUs
        ({"gpusPerWorker": 1, "memory": "64Gi"}, "8Gi"),  # 8Gi per GPU
        ({"gpusPerWorker": 8, "memory": "1Ti"}, "64Gi"),
        ({"gpusPerWorker": 8, "memory": "32Gi"}, "16Gi"),  # at most half the memory
        ({"gpusPerWorker": 2, "memory": "4Gi"}, "2Gi"),
        ({"gpusPerWorker": 0, "memory": "3Gi"}, "1536Mi"),
        ({"gpusPerWorker": 8, "memory": "1Ti", "shmSize": "100Gi"}, "100Gi"),  # as written
    ],
)
def test_shm_has_a_size_limit_that_scales_with_gpus(workers: dict[str, Any], size: str) -> None:
    assert _shm(_tg(pod=workers)) == {"medium": "Memory", "sizeLimit": size}


@pytest.mark.parametrize(("gpus", "memory", "shm"),
                         [(0, "32Gi", "2Gi"), (1, "64Gi", "8Gi"), (8, "288Gi", "64Gi")])
def test_memory_defaults_to_32gi_plus_32gi_per_gpu(gpus: int, memory: str, shm: str) -> None:
    _, worker = _ray_pods(_tg(pod={"gpusPerWorker": gpus, "memory": ""}))
    resources = worker["containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == memory
    assert _shm(_tg(pod={"gpusPerWorker": gpus, "memory": ""}))["sizeLimit"] == shm


def test_a_written_memory_is_kept() -> None:
    _, worker = _ray_pods(_tg(pod={"gpusPerWorker": 8, "memory": "100Gi"}))
    assert worker["containers"][0]["resources"]["limits"]["memory"] == "100Gi"


def test_the_tinker_servers_shm_is_half_its_memory() -> None:
    tg = _tg(api={"server": {"memory": "6Gi"}})
    (dshm,) = [v for v in _tinker_pod(tg)["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}


def test_nccl_debug_and_compile_threads_are_set_by_default() -> None:
    _, worker = _ray_pods(_tg())
    env = _env(worker["containers"][0])
    assert env["NCCL_DEBUG"] == "WARN"
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"  # 2 CPUs for 2 processes
    assert "NCCL_SOCKET_IFNAME" not in env


@pytest.mark.parametrize(
    ("cpu", "ppn", "threads"),
    [("64", [2], 8), ("16", [2], 8), ("12", [2], 6), ("8", [8], 1), ("500m", [1], 1)],
)
def test_compile_threads_are_the_pods_cpus_per_process_at_most_8(
    cpu: str, ppn: list[int], threads: int
) -> None:
    tg = _tg(pod={"cpu": cpu, "gpusPerWorker": max(ppn)},
             training={"batchSize": 8}, workers={"processesPerNode": ppn})
    assert pods.compile_threads(tg) == threads


def test_the_users_env_wins_over_the_defaults() -> None:
    tg = _tg(pod={"env": [{"name": "NCCL_DEBUG", "value": "INFO"},
                              {"name": "TORCHINDUCTOR_COMPILE_THREADS", "value": "32"}]})
    _, worker = _ray_pods(tg)
    names = [e["name"] for e in worker["containers"][0]["env"]]
    assert names.count("NCCL_DEBUG") == 1 and names.count("TORCHINDUCTOR_COMPILE_THREADS") == 1
    env = _env(worker["containers"][0])
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "32"


# -- multi-node NCCL: devices, host network, volumes -------------------------------------
def test_extended_resources_go_in_requests_and_limits() -> None:
    tg = _tg(pod={"extendedResources": [{"name": "rdma/ib", "count": 4},
                                            {"name": "vpc.amazonaws.com/efa"}]})
    _, worker = _ray_pods(tg)
    resources = worker["containers"][0]["resources"]
    for part in ("requests", "limits"):
        assert resources[part]["rdma/ib"] == "4"
        assert resources[part]["vpc.amazonaws.com/efa"] == "1"
        assert resources[part]["nvidia.com/gpu"] == "2"


@pytest.mark.parametrize("name", ["efa", "cpu", "rdma/", "/ib", "Rdma/ib"])
def test_an_extended_resource_needs_a_domain_prefixed_name(name: str) -> None:
    with pytest.raises(SpecErrors, match=r"spec\.rayCluster\.workers\.extendedResources\[0\]"):
        _tg(pod={"extendedResources": [{"name": name}]})


def test_gpus_are_not_an_extended_resource() -> None:
    with pytest.raises(SpecErrors) as info:
        _tg(pod={"extendedResources": [{"name": "nvidia.com/gpu", "count": 8}]})
    (err,) = info.value.errors
    assert err.field == "spec.rayCluster.workers.extendedResources"
    assert "gpusPerWorker" in err.fix


def test_host_network_sets_the_dns_policy_and_ncclsocket_interface() -> None:
    _, worker = _ray_pods(_tg(pod={"hostNetwork": True}))
    assert worker["hostNetwork"] is True
    assert worker["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert _env(worker["containers"][0])["NCCL_SOCKET_IFNAME"] == "^lo,docker,veth"
    _, worker = _ray_pods(_tg(pod={"hostNetwork": True, "ncclSocketIfname": "eth0"}))
    assert _env(worker["containers"][0])["NCCL_SOCKET_IFNAME"] == "eth0"
    head, worker = _ray_pods(_tg())
    assert "hostNetwork" not in worker and "hostNetwork" not in head


def test_extra_volumes_are_mounted_in_the_worker_container() -> None:
    tg = _tg(pod={"volumes": [
        {"name": "ib", "mountPath": "/dev/infiniband", "readOnly": True,
         "source": {"hostPath": {"path": "/dev/infiniband"}}},
        {"name": "plugin", "mountPath": "/usr/local/tcpx", "source": {"emptyDir": {}}},
    ]})
    _, worker = _ray_pods(tg)
    assert {"name": "ib", "hostPath": {"path": "/dev/infiniband"}} in worker["volumes"]
    assert {"name": "plugin", "emptyDir": {}} in worker["volumes"]
    mounts = worker["containers"][0]["volumeMounts"]
    assert {"name": "ib", "mountPath": "/dev/infiniband", "readOnly": True} in mounts
    assert {"name": "plugin", "mountPath": "/usr/local/tcpx"} in mounts


@pytest.mark.parametrize("name", ["dshm", "checkpoints"])
def test_an_extra_volume_may_not_take_the_operators_names(name: str) -> None:
    with pytest.raises(SpecErrors) as info:
        _tg(pod={"volumes": [{"name": name, "mountPath": "/x", "source": {"emptyDir": {}}}]})
    (err,) = info.value.errors
    assert err.field == "spec.rayCluster.workers.volumes"
    assert name in err.problem


def test_an_extra_volume_needs_a_name_a_path_and_a_source() -> None:
    with pytest.raises(SpecErrors) as info:
        _tg(pod={"volumes": [{"name": "Bad_Name", "mountPath": "relative"}]})
    fields = {e.field for e in info.value.errors}
    assert {"spec.rayCluster.workers.volumes[0].name",
            "spec.rayCluster.workers.volumes[0].mountPath",
            "spec.rayCluster.workers.volumes[0].source"} <= fields


# -- the restricted profile as a whole (what the kind suite's restricted namespace enforces) --
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def restricted_problems(pod: dict[str, Any]) -> list[str]:
    """What the restricted Pod Security Standard (v1.30) refuses in ``pod``, in short."""
    problems = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(key)
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume {v['name']}: {sorted(kinds)}")
    pod_sc = pod.get("securityContext") or {}
    for c in [*pod["containers"], *(pod.get("initContainers") or [])]:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{c['name']}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{c['name']}: capabilities not dropped")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{c['name']}: capabilities added {caps['add']}")
        if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
            problems.append(f"{c['name']}: runAsNonRoot")
        if 0 in (sc.get("runAsUser"), pod_sc.get("runAsUser")):
            problems.append(f"{c['name']}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{c['name']}: seccompProfile")
    return problems


def test_the_default_pods_pass_the_restricted_profile() -> None:
    tg = _tg(cluster=STORAGE, training={"checkpointDir": "/ckpt/run"},
             model={"pretrained": "/ckpt/llama", "positionEmbedding": "rope"})
    for pod in (*_ray_pods(tg), _tinker_pod(tg)):
        assert restricted_problems(pod) == []


def test_the_rdma_opt_ins_are_what_takes_the_workers_out_of_restricted() -> None:
    tg = _tg(pod={"capabilities": ["IPC_LOCK"], "hostNetwork": True, "volumes": [
        {"name": "ib", "mountPath": "/dev/infiniband",
         "source": {"hostPath": {"path": "/dev/infiniband"}}}]})
    head, worker = _ray_pods(tg)
    assert restricted_problems(head) == []
    assert restricted_problems(worker) == [
        "hostNetwork", "volume ib: ['hostPath']", "ray-worker: capabilities added ['IPC_LOCK']"
    ]
