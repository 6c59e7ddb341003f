"""examples/rl/toy_rl.py runs end to end (a local group, 2 iterations) and writes its outputs.

Whether the reward rises is the example's own check (its default run exits 1 otherwise);
two iterations are too few to assert it here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_ray import RayCluster

pytest.importorskip("ray")
pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

pytestmark = [pytest.mark.ray, pytest.mark.megatron, pytest.mark.flow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl" / "toy_rl.py"


def test_toy_rl_example_runs_and_writes_its_outputs(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    # on the session's Ray head (--address), not a private local Ray of its own (12-15 CPU s)
    args = ["--iterations", "2", "--out", str(tmp_path), "--no-check"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--address", ray_cluster.gcs_address],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "iter   2" in proc.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    history, summary = metrics["history"], metrics["summary"]
    assert len(history) == 2
    assert all(0.0 <= h["reward"] <= 1.0 and h["seconds"] > 0 for h in history)
    assert 0.0 <= summary["transformers_greedy_accuracy"] <= 1.0
    assert summary["export_hf_seconds"] > 0
    assert (tmp_path / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
