"""Real megatron-core on CPU over gloo: TP=2, PP=2 and DP=2 training, checkpoint and resume.

Two launches of two fresh processes each: the first trains TP=2 (checkpointing after step
3), PP=2 and DP=2; the second is a re-created TP=2 job that resumes from the checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.trainer import scenarios

pytestmark = pytest.mark.megatron

from tgruntime.trainer.launch import launch  # noqa: E402


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def suite(ckpt_root: Path) -> list[dict[str, Any]]:
    return launch(
        scenarios.parallel_suite,
        world_size=2,
        kwargs={"checkpoint_dir": str(ckpt_root)},
        timeout_s=300,
    )


@pytest.fixture(scope="module")
def resumed(suite: list[dict[str, Any]], ckpt_root: Path) -> list[dict[str, Any]]:
    return launch(
        scenarios.resume,
        world_size=2,
        kwargs={"checkpoint_dir": str(ckpt_root), "steps": 2},
        timeout_s=300,
    )


def _falls(losses: list[float]) -> bool:
    return all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.05


def test_tp2_loss_falls_and_ranks_agree(suite: list[dict[str, Any]]) -> None:
    r0, r1 = suite[0]["tp"], suite[1]["tp"]
    assert len(r0["losses"]) == 5 and _falls(r0["losses"]), r0["losses"]
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6, abs=1e-6)
    assert r0["per_sample"][-1] == pytest.approx(r1["per_sample"][-1], rel=1e-6)
    assert r0["grad_norms"] == pytest.approx(r1["grad_norms"], rel=1e-5)
    assert r0["steps"] == [1, 2, 3, 4, 5]
    assert r0["tokens"][0] == scenarios.BATCH * scenarios.SEQ
    assert len(r0["per_sample"][0]) == scenarios.BATCH


def test_tp2_mesh(suite: list[dict[str, Any]]) -> None:
    meshes = [r["tp"]["mesh"] for r in suite]
    assert [m["tp_rank"] for m in meshes] == [0, 1]
    assert all(m["tp_size"] == 2 and m["dp_size"] == 1 and m["pp_size"] == 1 for m in meshes)
    assert [m["is_collect"] for m in meshes] == [True, False]
    assert meshes[0]["backend"] == "gloo" and meshes[0]["dtype"] == "float32"
    assert meshes[0]["position_embedding"] == "learned_absolute"


def test_pp2_trains_and_stages_agree(suite: list[dict[str, Any]]) -> None:
    r0, r1 = suite[0]["pp"], suite[1]["pp"]
    assert [r["mesh"]["pp_rank"] for r in (r0, r1)] == [0, 1]
    assert [r["mesh"]["is_collect"] for r in (r0, r1)] == [False, True]
    assert _falls(r1["losses"]), r1["losses"]
    # the last stage's losses are broadcast to the first stage
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)
    assert r0["grad_norms"] == pytest.approx(r1["grad_norms"], rel=1e-5)


def test_dp2_replicas_stay_in_sync(suite: list[dict[str, Any]]) -> None:
    r0, r1 = suite[0]["dp"], suite[1]["dp"]
    assert [r["mesh"]["dp_rank"] for r in (r0, r1)] == [0, 1]
    assert r0["losses"][0] != pytest.approx(r1["losses"][0])  # different data
    assert r0["grad_norms"] == pytest.approx(r1["grad_norms"], rel=1e-5)  # averaged gradient
    assert r0["checksum"] == pytest.approx(r1["checksum"], rel=1e-9)  # same weights


def test_rope_gqa_layernorm_gelu_variant(suite: list[dict[str, Any]]) -> None:
    r0, r1 = suite[0]["variant"], suite[1]["variant"]
    assert r0["mesh"]["position_embedding"] == "rope"
    assert _falls(r0["losses"]), r0["losses"]
    assert r0["losses"] == pytest.approx(r1["losses"], rel=1e-6)


def test_checkpoint_layout(suite: list[dict[str, Any]], ckpt_root: Path) -> None:
    saved = Path(suite[0]["tp"]["saved"])
    assert saved == ckpt_root / "step_00000003"
    meta = json.loads((saved / "meta.json").read_text())
    assert (meta["step"], meta["tp"], meta["pp"]) == (3, 2, 1)
    assert sorted(p.name for p in saved.glob("*.pt")) == [
        "shard_tp00_pp000.pt",
        "shard_tp01_pp000.pt",
    ]


def test_resume_continues_from_checkpoint(
    suite: list[dict[str, Any]], resumed: list[dict[str, Any]]
) -> None:
    original = suite[0]["tp"]["losses"]  # steps 1..5; the checkpoint holds step 3
    for rank in resumed:
        assert rank["loaded_step"] == 3
        assert rank["steps"] == [4, 5]
        assert rank["losses"] == pytest.approx(original[3:5], rel=1e-5, abs=1e-6)
    # resumed, not from scratch: the first resumed loss is far below the first loss
    assert resumed[0]["losses"][0] < original[0] - 0.05
