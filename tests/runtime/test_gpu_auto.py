"""The embedded default on GPU machines: GPU detection for a new local head, ``useGpu: auto``
resolved by the server against the Ray cluster, the device the workers actually use in the
ready line, the record and ``tgctl status``, and groups the cluster can never hold failing at
once (before any wait on placement groups).

Real parts: the session's local Ray head (2 CPUs, no GPUs) and, for the detection test, a
second head started by ``tgctl up`` itself with logical GPUs taken from CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures_ray import REPO_ROOT, RayCluster, tgctl_env
from tests.runtime.light_workers import Counter
from tgruntime.controller import PlacementInfeasibleError, ResourcePool, WorkerGroup, registry
from tgruntime.controller.resource_pool import infeasibility
from tgruntime.local.cluster import detect_gpus

ECHO = "tests.runtime.light_workers:SpecEcho"


# ----------------------------------------------------------------------------- pure logic
def test_infeasibility_names_what_can_never_fit() -> None:
    node16 = {"CPU": 16.0, "memory": 1e11}
    gpu_node = {"CPU": 16.0, "GPU": 8.0}
    two_gpu_bundles = [[{"CPU": 1.0, "GPU": 1.0}] * 2]
    reason = infeasibility(two_gpu_bundles, "STRICT_PACK", [node16])
    assert reason is not None and "GPU (2 asked, 0 in the cluster)" in reason
    assert infeasibility(two_gpu_bundles, "STRICT_PACK", [gpu_node]) is None
    # Totals suffice, but no single node holds a bundle.
    assert "no node can hold" in str(
        infeasibility([[{"CPU": 3.0}]], "PACK", [{"CPU": 2.0}, {"CPU": 2.0}])
    )
    # STRICT_PACK: the whole group on one node; PACK may split it.
    split = [[{"CPU": 2.0}] * 2]
    assert "STRICT_PACK" in str(infeasibility(split, "STRICT_PACK", [{"CPU": 2.0}, {"CPU": 2.0}]))
    assert infeasibility(split, "PACK", [{"CPU": 2.0}, {"CPU": 2.0}]) is None
    # STRICT_SPREAD: a distinct node per bundle.
    assert "distinct nodes" in str(infeasibility(split, "STRICT_SPREAD", [{"CPU": 8.0}]))
    # Fractional amounts add up exactly (no float noise rejection).
    assert infeasibility([[{"CPU": 0.1}] * 20], "PACK", [{"CPU": 2.0}]) is None


@pytest.mark.parametrize(
    ("visible", "count"),
    [("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("0,-1,2", 1), ("GPU-1a2b,GPU-3c4d", 2)],
)
def test_detect_gpus_reads_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, count: int
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = detect_gpus()
    assert found.count == count and "CUDA_VISIBLE_DEVICES" in found.source


def test_detect_gpus_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found = detect_gpus()
    if not Path("/proc/driver/nvidia/gpus").is_dir() and not _which("nvidia-smi"):
        assert (found.count, found.source) == (0, "no NVIDIA driver found")
    else:
        assert found.count >= 0 and found.source


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


# ----------------------------------------------------------------------------- real Ray
def _spec(tmp_path: Path, **workers: Any) -> tuple[Path, dict[str, Any]]:
    name = f"g{uuid.uuid4().hex[:8]}"
    workers = {k: v for k, v in workers.items() if v is not None}
    doc: dict[str, Any] = {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name},
        "spec": {
            "workers": {
                "processesPerNode": [2],
                "cpusPerProcess": 0.1,
                "workerClass": ECHO,
                "rayNamespace": f"ns-{name}",
                **workers,
            },
            "model": {
                "vocabSize": 16,
                "hiddenSize": 8,
                "numLayers": 1,
                "numAttentionHeads": 2,
                "ffnHiddenSize": 16,
                "maxSequenceLength": 8,
            },
            "training": {"batchSize": 2, "sequenceLength": 8},
        },
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path, doc


def _tagged(tag: str, text: str) -> dict[str, Any] | None:
    found = None
    for line in text.splitlines():
        if line.startswith(tag + " "):
            found = json.loads(line[len(tag) + 1 :])
    return found


def _run(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.ray
def test_infeasible_group_fails_at_once_and_leaves_nothing(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    import ray

    pool = ResourcePool(process_on_nodes=[2], use_gpu=True, cpus_per_process=1)
    # PlacementInfeasibleError comes from the check before any placement group is made (a
    # wait for placement would end in PlacementTimeoutError after the 600 s instead)
    with pytest.raises(PlacementInfeasibleError) as info:
        WorkerGroup.create(
            group_name="gpus",
            ray_namespace=unique_namespace,
            resource_pool=pool,
            cls=Counter,
            pg_timeout_s=600,
        )
    text = str(info.value)
    cpus = ray.cluster_resources()["CPU"]  # type: ignore[no-untyped-call]
    assert "asked 2 bundles of {CPU=1, GPU=1}" in text, text
    assert f"the cluster has {{CPU={cpus:g}, GPU=0}}" in text, text
    assert "Fix:" in text and "GPU" in text
    assert registry.load_members(group_name="gpus", ray_namespace=unique_namespace) is None
    from ray.util.placement_group import placement_group_table

    names = [p.get("name", "") for p in placement_group_table().values()]
    assert not [n for n in names if unique_namespace in n]


@pytest.mark.ray
def test_server_resolves_auto_to_cpu_and_reports_the_device(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    path, doc = _spec(tmp_path, useGpu=None)  # the default: "auto"
    name, ns = doc["metadata"]["name"], doc["spec"]["workers"]["rayNamespace"]
    env = ray_cluster.env()
    server = _run(env, "-m", "tgruntime.entrypoints.server", "-f", str(path))
    ready = _tagged("TG_GROUP_READY", server.stdout)
    assert server.returncode == 0 and ready is not None, server.stderr[-3000:]
    assert ready["useGpu"] is False
    assert (ready["device"], ready["backend"], ready["dtype"]) == ("cpu", "gloo", "float32")
    assert "workers.useGpu auto -> false" in server.stderr
    try:
        probe = ray_cluster.run_python(f"""
            import json
            from tgruntime.controller import load_record
            from tgruntime.controller.connect import connect
            connect(ray_namespace={ns!r})
            r = load_record(group_name={name!r}, ray_namespace={ns!r})
            echo = __import__("tgruntime.controller", fromlist=["WorkerGroup"]).WorkerGroup
            wg = echo.attach(group_name={name!r}, ray_namespace={ns!r})
            print("REC " + json.dumps({{"use_gpu": r.use_gpu, "device": dict(r.device),
                                        "seen": [x["use_gpu"] for x in wg.init_model()]}}))
        """)
        rec = _tagged("REC", probe)
        assert rec == {
            "use_gpu": False,
            "device": {"device": "cpu", "backend": "gloo", "dtype": "float32"},
            "seen": [False, False],  # the workers got the resolved spec, not "auto"
        }
        status = _run(env, "-m", "tgruntime.entrypoints.cli", "status", "-f", str(path),
                      "--address", ray_cluster.gcs_address)
        assert "device: cpu (gloo, float32); workers.useGpu resolved to false" in status.stdout, (
            status.stdout + status.stderr[-2000:]
        )
    finally:
        _run(env, "-m", "tgruntime.entrypoints.teardown", "--group", name, "--ray-namespace", ns)


@pytest.mark.ray
def test_server_with_gpu_workers_on_a_cpu_cluster_fails_at_once(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    path, doc = _spec(tmp_path, useGpu=True, cpusPerProcess=1)
    (doc["spec"].setdefault("timeouts", {}))["workersReadySeconds"] = 600
    path.write_text(yaml.safe_dump(doc))
    # timeout=200: far below the spec's 600 s wait, so the refusal must come up front
    server = _run(
        ray_cluster.env(), "-m", "tgruntime.entrypoints.server", "-f", str(path), timeout=200
    )
    failed = _tagged("TG_GROUP_FAILED", server.stdout)
    assert server.returncode == 1 and failed is not None, server.stderr[-3000:]
    assert failed["kind"] == "PlacementInfeasibleError"
    error = failed["error"]
    assert "asked 2 bundles of {CPU=1, GPU=1}" in error and "GPU=0}" in error, error
    assert "set workers.useGpu: false" in error and "start the Ray head with GPUs" in error


@pytest.mark.ray
@pytest.mark.flow
def test_tgctl_up_detects_gpus_for_a_new_head_and_auto_uses_them(tmp_path: Path) -> None:
    """No flags: `tgctl up` starts its own head with the GPUs it detects (here: two logical
    GPUs named by CUDA_VISIBLE_DEVICES), "auto" then puts the workers on GPUs."""
    path, _ = _spec(tmp_path, useGpu="auto")
    # no remembered head: a new one; without the dashboard (~6 CPU-s to start, and nothing
    # here reads it: test_cli_fast covers tgctl on such a head)
    env = tgctl_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", TG_RAY_INCLUDE_DASHBOARD="0")
    up = _run(
        env, "-m", "tgruntime.entrypoints.cli", "up", "-f", str(path), "--num-cpus", "2",
        timeout=600,
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr[-4000:]
        assert "detected 2 GPU(s) (CUDA_VISIBLE_DEVICES)" in up.stderr
        assert "with 2 CPUs and 2 GPUs" in up.stderr
        assert "device: cuda (nccl, bfloat16); workers.useGpu resolved to true" in up.stdout
        status = _run(env, "-m", "tgruntime.entrypoints.cli", "status", "-f", str(path))
        assert "phase: Ready" in status.stdout, status.stdout + status.stderr[-2000:]
        assert "device: cuda (nccl, bfloat16)" in status.stdout
        # Three GPU workers on a 2-GPU head: refused at once, saying what exists.
        path3, doc3 = _spec(tmp_path, useGpu=True, processesPerNode=[3])
        doc3["spec"]["training"]["batchSize"] = 3  # divisible by the data-parallel size
        path3.write_text(yaml.safe_dump(doc3))
        three = _run(env, "-m", "tgruntime.entrypoints.cli", "up", "-f", str(path3), timeout=300)
        assert three.returncode == 1
        assert "asked 3 bundles of {CPU=0.1, GPU=1}" in three.stderr, three.stderr[-3000:]
        assert "the cluster has 2 GPU(s) for 3 GPU workers" in three.stderr
    finally:
        down = _run(env, "-m", "tgruntime.entrypoints.cli", "down", "-f", str(path), "--stop-ray")
        assert "stopped the local Ray head" in down.stdout, down.stdout + down.stderr[-2000:]
