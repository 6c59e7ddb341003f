"""One resume point, up to the group's status (issue 36): a two-rank group on the session's
Ray whose ranks see different checkpoint directories (per-node disks, faked by
``checkpoint_scenarios.PerNodeDiskTrainer``: ``checkpointDir/node{rank}``) fails at
``init_model`` with ``CheckpointUnreadableError`` naming rank 1's path, the step and the node;
the server's ``TG_GROUP_FAILED`` line and the TrainerGroup's Failed condition carry it.

The checkpoints are fakes (``meta.json`` and shard files): the check runs before any shard is
read, so no model state is needed.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_ray import REPO_ROOT, RayCluster
from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.checkpoint import step_dirname

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

MODEL = {
    "vocabSize": 32,
    "hiddenSize": 16,
    "numLayers": 1,
    "numAttentionHeads": 2,
    "ffnHiddenSize": 32,
    "maxSequenceLength": 8,
}


def _fake_checkpoint(root: Path, step: int) -> None:
    path = root / step_dirname(step)
    path.mkdir(parents=True)
    (path / "shard_tp00_pp000.pt").write_bytes(b"not read: the check fails first")
    ckpt.write_meta(path, {"step": step, "tp": 1, "pp": 1, "dp": 2})


def _failed(text: str) -> dict[str, Any] | None:
    found = None
    for line in text.splitlines():
        if line.startswith("TG_GROUP_FAILED "):
            found = json.loads(line[len("TG_GROUP_FAILED ") :])
    return found


def test_a_rank_without_rank_0s_checkpoint_fails_the_group_with_the_path(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    import yaml

    root = tmp_path / "ckpt"
    _fake_checkpoint(root / "node0", 1)
    _fake_checkpoint(root / "node0", 2)
    _fake_checkpoint(root / "node1", 1)  # node 1's disk never got step 2
    name = f"resume{uuid.uuid4().hex[:6]}"
    doc = {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name},
        "spec": {
            "workers": {
                "useGpu": False,
                "processesPerNode": [2],
                "cpusPerProcess": 0.5,
                "workerClass": "tests.trainer.checkpoint_scenarios:PerNodeDiskTrainer",
                "rayNamespace": f"ns-{name}",
            },
            "model": MODEL,
            "training": {"batchSize": 2, "sequenceLength": 8, "checkpointDir": str(root)},
        },
    }
    path = tmp_path / "tg.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [sys.executable, "-m", "tgruntime.entrypoints.server", "-f", str(path)],
        cwd=REPO_ROOT,
        env=ray_cluster.env(),
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    failed = _failed(proc.stdout)
    assert proc.returncode == 1 and failed is not None, proc.stdout + proc.stderr[-4000:]
    error = failed["error"]
    missing = str(root / "node1" / step_dirname(2))
    assert "CheckpointUnreadableError" in error, error
    assert f"rank 1 on node {socket.gethostname()} cannot read step 2 at {missing}" in error
    assert "TG_GROUP_READY" not in proc.stdout

    # The operator reads the server job's log: the group is Failed, its condition names the path.
    from tests.operator.snapshots import SETTINGS, job, snap
    from tg_operator import decide

    d = decide.decide(snap(job=job("FAILED"), job_logs=proc.stdout), settings=SETTINGS)
    assert d.status.phase == "Failed" and d.failure == "ServerFailed", d
    (cond,) = [c for c in d.status.conditions if c.reason == "ServerFailed"]
    assert cond.status == "False" and missing in cond.message, cond.message
