"""GPU or fail: a rank asked for a GPU (``workers.useGpu: true``) that finds no CUDA device
raises ``NoCudaDeviceError`` (the driver seen, the CUDA the image's torch needs and the
minimum driver for it, the fix) instead of training on the CPU, and the message reaches the
server's ``TG_GROUP_FAILED`` line and the TrainerGroup's Failed condition.

The "no CUDA" ranks are faked on CPU: ``torch.cuda.is_available`` patched to False inside
the launched rank (or the Ray worker, :data:`NO_CUDA_TRAINER`), while the spec asks for GPUs.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import tgapi
from tests.fixtures_ray import REPO_ROOT, RayCluster
from tgruntime.trainer import gpu_check
from tgruntime.trainer.gpu_check import NO_DRIVER, NoCudaDeviceError, no_cuda_error
from tgruntime.trainer.settings import resolve_settings

NO_CUDA_TRAINER = "tests.trainer.test_gpu_check:NoCudaTrainer"

MODEL = {
    "vocabSize": 32,
    "hiddenSize": 16,
    "numLayers": 1,
    "numAttentionHeads": 2,
    "ffnHiddenSize": 32,
    "maxSequenceLength": 8,
}


def _spec(use_gpu: Any) -> tgapi.TrainerGroupSpec:
    return tgapi.parse_spec(
        {
            "workers": {"useGpu": use_gpu, "processesPerNode": [1]},
            "model": MODEL,
            "training": {"batchSize": 2, "sequenceLength": 8},
        },
        local=True,
    )


# ----------------------------------------------------------------------------- the driver
def test_driver_version_from_the_kernel_module(tmp_path: Path) -> None:
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC "
        "2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    assert gpu_check.driver_version(proc, smi=None) == "535.129.03"
    proc.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
        "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 2025\n"
    )
    assert gpu_check.driver_version(proc, smi=None) == "570.86.15"


def _fake_smi(tmp_path: Path, body: str) -> str:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return str(smi)


def test_driver_version_from_nvidia_smi_or_none(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    assert gpu_check.driver_version(missing, smi=None) == NO_DRIVER
    assert gpu_check.driver_version(missing, smi=str(tmp_path / "no-smi")) == NO_DRIVER
    ok = _fake_smi(tmp_path, 'echo "550.54.15"; echo "550.54.15"')
    assert gpu_check.driver_version(missing, smi=ok) == "550.54.15"
    broken = _fake_smi(
        tmp_path,
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; "
        "exit 9",
    )
    seen = gpu_check.driver_version(missing, smi=broken)
    assert seen.startswith(NO_DRIVER) and "exit 9" in seen and "NVIDIA-SMI has failed" in seen


def test_minimum_driver_per_cuda_major() -> None:
    assert gpu_check.min_driver_for("13.0") == "580.65.06"
    assert gpu_check.min_driver_for("13.2") == "580.65.06"
    assert gpu_check.min_driver_for("12.8") == "525.60.13"
    assert gpu_check.min_driver_for("11.8") == "450.80.02"
    assert gpu_check.min_driver_for(None) is None and gpu_check.min_driver_for("x") is None


# ----------------------------------------------------------------------------- the message
def test_an_old_driver_names_what_it_has_what_is_needed_and_the_fix() -> None:
    error = no_cuda_error(rank=3, driver="535.129.03", torch_cuda="13.0")
    text = str(error)
    assert "\n" not in text  # WorkerMethodError keeps the first line of a rank's error
    assert "rank 3 sees no CUDA device" in text
    assert "NVIDIA driver seen: 535.129.03" in text
    assert "built for CUDA 13.0, which needs NVIDIA driver >= 580.65.06" in text
    assert "Fix: run on nodes with NVIDIA driver >= 580.65.06" in text
    assert "runtime image variant built for CUDA 12" in text and ">= 525.60.13" in text
    assert "workers.useGpu: false" in text
    assert (error.driver, error.torch_cuda, error.min_driver) == ("535.129.03", "13.0", "580.65.06")


def test_no_driver_a_recent_driver_and_a_cpu_build() -> None:
    none = str(no_cuda_error(rank=0, driver=NO_DRIVER, torch_cuda="13.0"))
    assert "NVIDIA driver seen: no NVIDIA driver" in none and ">= 580.65.06" in none
    recent = str(no_cuda_error(rank=0, driver="580.95.05", torch_cuda="13.0"))
    assert "the driver meets the minimum" in recent and "nvidia.com/gpu" in recent
    cu12 = str(no_cuda_error(rank=0, driver="520.61.05", torch_cuda="12.8"))
    assert ">= 525.60.13" in cu12 and "variant built for CUDA 12" not in cu12
    cpu = str(no_cuda_error(rank=None, driver=NO_DRIVER, torch_cuda=None, probe_torch=False))
    assert "this process sees no CUDA device" in cpu and "CPU-only build" in cpu


# ----------------------------------------------------------------------------- the settings
def test_use_gpu_true_without_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(NoCudaDeviceError) as info:
        resolve_settings(_spec(True))
    assert info.value.rank == 1
    assert "NVIDIA driver seen:" in str(info.value) and "Fix:" in str(info.value)
    assert info.value.torch_cuda == torch.version.cuda
    with pytest.raises(NoCudaDeviceError):  # a forced device too
        resolve_settings(_spec(False), device="cuda")


def test_false_and_unresolved_auto_still_use_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value in (False, "auto"):
        s = resolve_settings(_spec(value))
        assert (s.device, s.backend, s.dtype) == ("cpu", "gloo", torch.float32), value


def test_the_cpu_image_variant_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """TG_ALLOW_CPU_FALLBACK=1 (set only in the runtime image's CPU variant) lets a GPU-asking
    rank run on the CPU, loudly; anything but "1" keeps GPU-or-fail."""
    from tgruntime.trainer.gpu_check import CPU_FALLBACK_ENV, cpu_fallback_allowed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(CPU_FALLBACK_ENV, "yes")
    assert not cpu_fallback_allowed()
    with pytest.raises(NoCudaDeviceError):
        resolve_settings(_spec(True))
    monkeypatch.setenv(CPU_FALLBACK_ENV, "1")
    assert cpu_fallback_allowed()
    with caplog.at_level("WARNING"):
        s = resolve_settings(_spec(True))
    assert (s.device, s.backend) == ("cpu", "gloo")
    assert CPU_FALLBACK_ENV in caplog.text
    dockerfile = (Path(__file__).resolve().parents[2] / "images" / "runtime.Dockerfile").read_text()
    cpu_stage = dockerfile.split("FROM deps AS cuda-cpu")[1].split("FROM cuda-${VARIANT}")[0]
    gpu_stage = dockerfile.split("FROM deps AS cuda-gpu")[1].split("FROM deps AS cuda-cpu")[0]
    assert f"ENV {CPU_FALLBACK_ENV}=1" in cpu_stage and CPU_FALLBACK_ENV not in gpu_stage


# ----------------------------------------------------------------------------- a launched rank
def no_cuda_rank() -> str:
    """A launched rank on a machine "without CUDA" that builds the engine for useGpu: true."""
    torch.cuda.is_available = lambda: False
    from tgruntime.trainer import TrainEngine

    TrainEngine.create(spec=_spec(True))
    return "trained on the CPU"


@pytest.mark.megatron
def test_a_launched_no_cuda_rank_fails_with_the_message() -> None:
    from tgruntime.trainer.launch import LaunchError, launch

    with pytest.raises(LaunchError) as info:
        launch(no_cuda_rank, world_size=1, timeout_s=300)
    text = str(info.value)
    assert "NoCudaDeviceError" in text and "rank 0 sees no CUDA device" in text, text
    assert "NVIDIA driver seen:" in text and f"CUDA {torch.version.cuda}" in text


# ----------------------------------------------------------------------------- up to the status
def __getattr__(name: str) -> Any:
    """``NoCudaTrainer``: the built-in trainer whose ``init_model`` sees no CUDA device.

    Built on first access (Ray workers import it by name), so the tests above do not pay for
    importing megatron-core."""
    if name != "NoCudaTrainer":
        raise AttributeError(name)
    from tgruntime.trainer.worker import MegatronTrainer

    class NoCudaTrainer(MegatronTrainer):
        def __init__(self, spec_json: str, lora_json: str | None = None) -> None:
            torch.cuda.is_available = lambda: False
            super().__init__(spec_json, lora_json)

    NoCudaTrainer.__module__ = __name__
    globals()[name] = NoCudaTrainer
    return NoCudaTrainer


# The server with the plan's pool on CPUs (the session's Ray head has no GPUs): the workers
# still get the spec with useGpu: true, as on a GPU node whose driver is too old.
_SERVER = """
    import dataclasses
    import sys
    from tgruntime.entrypoints import server
    from tgruntime.launch import plan

    real = plan.resource_pool
    def cpu_pool(spec):
        return dataclasses.replace(real(spec), use_gpu=False)
    plan.resource_pool = cpu_pool
    sys.exit(server.main(["-f", sys.argv[1]]))
"""


def _tagged(tag: str, text: str) -> dict[str, Any] | None:
    found = None
    for line in text.splitlines():
        if line.startswith(tag + " "):
            found = json.loads(line[len(tag) + 1 :])
    return found


def _run_server(ray_cluster: RayCluster, tmp_path: Path, worker_class: str) -> tuple[
    subprocess.CompletedProcess[str], dict[str, Any] | None
]:
    """The server (plan's pool on CPUs) for a useGpu: true group of ``worker_class``."""
    import yaml

    name = f"nocuda{uuid.uuid4().hex[:6]}"
    doc = {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name},
        "spec": {
            "workers": {
                "useGpu": True,
                "processesPerNode": [1],
                "cpusPerProcess": 0.5,
                "workerClass": worker_class,
                "rayNamespace": f"ns-{name}",
            },
            "model": MODEL,
            "training": {"batchSize": 2, "sequenceLength": 8},
        },
    }
    path = tmp_path / "tg.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SERVER), str(path)],
        cwd=REPO_ROOT,
        env=ray_cluster.env(),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    return proc, _tagged("TG_GROUP_FAILED", proc.stdout)


@pytest.mark.ray
def test_a_worker_class_reporting_a_cpu_fallback_fails_the_group(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """A worker class of the user's own (here the test SpecEcho, which reports "cpu" when Ray
    gave it no GPU) that runs on the CPU with useGpu: true: the server refuses the group."""
    proc, failed = _run_server(ray_cluster, tmp_path, "tests.runtime.light_workers:SpecEcho")
    assert proc.returncode == 1 and failed is not None, proc.stdout + proc.stderr[-4000:]
    assert failed["kind"] == "GpuWorkersOnCpuError", failed
    assert "workers report device 'cpu'" in failed["error"], failed
    assert "Fix:" in failed["error"] and "workers.useGpu: false" in failed["error"]
    assert "TG_GROUP_READY" not in proc.stdout


@pytest.mark.ray
@pytest.mark.megatron
def test_no_cuda_ranks_fail_the_group_and_the_status_says_why(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    proc, failed = _run_server(ray_cluster, tmp_path, NO_CUDA_TRAINER)
    assert proc.returncode == 1 and failed is not None, proc.stdout + proc.stderr[-4000:]
    error = failed["error"]
    assert failed["kind"] == "WorkerMethodError", failed
    assert "init_model() raised NoCudaDeviceError on rank 0" in error, error
    assert "workers.useGpu is true but rank 0 sees no CUDA device" in error
    assert "NVIDIA driver seen:" in error and f"CUDA {torch.version.cuda}" in error
    assert "Fix:" in error and "workers.useGpu: false" in error

    # The operator reads the server job's log: the group is Failed, its condition says why.
    from tests.operator.snapshots import SETTINGS, job, snap
    from tg_operator import decide

    d = decide.decide(snap(job=job("FAILED"), job_logs=proc.stdout), settings=SETTINGS)
    assert d.status.phase == "Failed" and d.failure == "ServerFailed", d
    first_line = error.splitlines()[0]
    assert first_line in d.status.message, d.status.message
    (cond,) = [c for c in d.status.conditions if c.reason == "ServerFailed"]
    assert cond.status == "False" and "sees no CUDA device" in cond.message
    assert "NVIDIA driver seen:" in cond.message and "Fix:" in cond.message
