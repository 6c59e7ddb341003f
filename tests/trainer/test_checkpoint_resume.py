"""One resume point and saves that outlast the training group's timeout (issue 36).

Units (in-process, no process group): the typed error, stray temporary files, pruning,
the settings. Then two launches of two gloo ranks (TP=2, real megatron-core on CPU):

1. One shared root, a checkpoint after every step with ``TG_KEEP_CHECKPOINTS=2``: only the
   newest two stay; one save's shard write lasts longer than the default process group's
   timeout and the other rank waits it out on the checkpoint I/O group.
2. Each rank on its own root (per-node disks): when rank 1's root holds a newer step, both
   ranks still resume from rank 0's choice; when rank 1's root lacks rank 0's choice, the
   launch fails with CheckpointUnreadableError naming rank 1's path, the step and the node,
   raised on both ranks.
"""

from __future__ import annotations

import datetime
import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.trainer import checkpoint_scenarios
from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.checkpoint import CheckpointUnreadableError, step_dirname
from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.launch import LaunchError, launch

GROUP_TIMEOUT_S, SLOW_S = 8.0, 14.0


def _mesh(rank: int = 0, *, tp_rank: int = 0, dp_rank: int = 0) -> Mesh:
    return Mesh(rank=rank, world_size=4, tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1,
                cp_rank=0, cp_size=1, dp_rank=dp_rank, dp_size=2)


def _complete(root: Path, step: int, *, shards: int = 2) -> Path:
    path = root / step_dirname(step)
    path.mkdir(parents=True)
    for tp in range(shards):
        (path / f"shard_tp{tp:02d}_pp000.pt").write_bytes(b"x")
    ckpt.write_meta(path, {"step": step, "tp": shards, "pp": 1})
    return path


# -- units ---------------------------------------------------------------------------------
def test_verify_readable_names_path_step_and_node(tmp_path: Path) -> None:
    good = _complete(tmp_path, 4)
    assert ckpt.verify_readable(good, step=4, mesh=_mesh()) == 4
    missing = tmp_path / step_dirname(9)
    with pytest.raises(CheckpointUnreadableError) as info:
        ckpt.verify_readable(missing, step=9, mesh=_mesh())
    err = info.value
    assert (err.path, err.step, err.rank, err.failed_ranks) == (str(missing), 9, 0, [0])
    assert err.node == socket.gethostname()
    text = str(err)
    assert str(missing) in text and "step 9" in text and socket.gethostname() in text
    assert "does not exist" in text and "checkpointDir" in text
    with pytest.raises(CheckpointUnreadableError, match="of step 4, not 5"):
        ckpt.verify_readable(good, step=5)
    (good / "shard_tp01_pp000.pt").unlink()
    with pytest.raises(CheckpointUnreadableError, match=r"shard_tp01_pp000\.pt is missing"):
        ckpt.verify_readable(good, step=4, mesh=_mesh(1, tp_rank=1))


def test_clean_stray_temps_removes_only_this_ranks_names(tmp_path: Path) -> None:
    step = _complete(tmp_path, 3)
    half = tmp_path / step_dirname(4)
    half.mkdir()
    names = {
        step / "shard_tp00_pp000.tmp123": "rank 0's shard",
        half / "shard_tp00_pp000.tmp77": "rank 0's shard",
        half / "shard_tp01_pp000.tmp77": "rank 1's shard",
        half / "meta.tmp77": "rank 0's meta",
        tmp_path / "meta.tmp5": "rank 0's meta",
        half / "notes.tmp1": "not ours",
        tmp_path / "other" / "shard_tp00_pp000.tmp1": "not a step directory",
    }
    for path in names:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("partial")
    # a data-parallel replica (dp rank 1) writes nothing, so removes nothing
    assert ckpt.clean_stray_temps(tmp_path, _mesh(2, dp_rank=1)) == []
    removed = ckpt.clean_stray_temps(tmp_path, _mesh(0))
    assert sorted(removed) == sorted(p for p, who in names.items() if who.startswith("rank 0"))
    rank1 = ckpt.clean_stray_temps(tmp_path, _mesh(1, tp_rank=1))
    assert rank1 == [half / "shard_tp01_pp000.tmp77"]
    assert sorted(p for p in names if p.exists()) == sorted(
        [half / "notes.tmp1", tmp_path / "other" / "shard_tp00_pp000.tmp1"]
    )
    assert (step / "meta.json").is_file() and (step / "shard_tp00_pp000.pt").is_file()


def test_prune_keeps_the_newest_complete_and_the_saved(tmp_path: Path) -> None:
    for s in (1, 2, 5, 7):
        _complete(tmp_path, s)
    (tmp_path / step_dirname(3)).mkdir()  # an interrupted save, older than the new one
    (tmp_path / step_dirname(9)).mkdir()  # newer: maybe being written; left alone
    (tmp_path / "tinker").mkdir()
    (tmp_path / "step_12").mkdir()  # not our name
    assert ckpt.prune(tmp_path, 0, saved=tmp_path / step_dirname(7)) == []
    # the engine prunes only after a save into a step_* directory of checkpointDir
    assert ckpt.is_step_dir(tmp_path / step_dirname(7))
    assert not ckpt.is_step_dir(tmp_path / "step_12") and not ckpt.is_step_dir(tmp_path / "mine")
    removed = ckpt.prune(tmp_path, 2, saved=tmp_path / step_dirname(7))
    assert sorted(p.name for p in removed) == [step_dirname(s) for s in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [step_dirname(5), step_dirname(7), step_dirname(9), "step_12", "tinker"]
    )
    # the one just saved is kept even when it is not among the newest (a re-save of step 5)
    _complete(tmp_path, 8)
    ckpt.prune(tmp_path, 1, saved=tmp_path / step_dirname(5))
    assert {step_dirname(5), step_dirname(8)} <= {p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / step_dirname(7)).exists()


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ckpt.ENV_IO_TIMEOUT, raising=False)
    monkeypatch.delenv(ckpt.ENV_KEEP, raising=False)
    assert ckpt.io_timeout() == datetime.timedelta(hours=2)
    monkeypatch.setenv(ckpt.ENV_IO_TIMEOUT, "90.5")
    assert ckpt.io_timeout() == datetime.timedelta(seconds=90.5)
    for bad in ("0", "-3", "two hours"):
        monkeypatch.setenv(ckpt.ENV_IO_TIMEOUT, bad)
        with pytest.raises(ValueError, match=ckpt.ENV_IO_TIMEOUT):
            ckpt.io_timeout()

    class Training:
        keep_checkpoints = 0

    class Spec:
        training = Training()

    assert ckpt.keep_checkpoints(Spec()) == 0
    monkeypatch.setenv(ckpt.ENV_KEEP, "3")
    assert ckpt.keep_checkpoints(Spec()) == 3  # the spec's 0 (unset): the environment's
    Training.keep_checkpoints = 5
    assert ckpt.keep_checkpoints(Spec()) == 5  # the spec's own value wins
    assert ckpt.keep_checkpoints(object()) == 3  # a spec without the field
    monkeypatch.setenv(ckpt.ENV_KEEP, "-1")
    with pytest.raises(ValueError, match=ckpt.ENV_KEEP):
        ckpt.keep_checkpoints(object())


# -- two gloo ranks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("shared")
    results = launch(
        checkpoint_scenarios.save_every_step,
        world_size=2,
        kwargs={"root": str(root), "steps": 3, "slow_step": 2, "slow_s": SLOW_S,
                "group_timeout_s": GROUP_TIMEOUT_S},
        env={ckpt.ENV_KEEP: "2", ckpt.ENV_IO_TIMEOUT: "600"},
        timeout_s=400,
    )
    return root, results


@pytest.mark.megatron
def test_saves_keep_the_newest_and_outlast_the_group_timeout(
    shared: tuple[Path, list[dict[str, Any]]],
) -> None:
    root, results = shared
    names = [step_dirname(s) for s in (1, 2, 3)]
    for r in results:
        assert r["step"] == 3 and r["saved"] == [str(root / n) for n in names]
        # the other rank waited the slow shard write out, past the default group's timeout
        assert r["waited"] > GROUP_TIMEOUT_S
    assert results[0]["left"][-1] == names[1:]  # keepCheckpoints 2: step 1 pruned
    assert results[0]["left"][1] == names[:2]
    assert sorted(p.name for p in root.iterdir()) == names[1:]
    for n in names[1:]:
        assert sorted(p.name for p in (root / n).iterdir()) == [
            "meta.json", "shard_tp00_pp000.pt", "shard_tp01_pp000.pt"
        ]


@pytest.mark.megatron
def test_every_rank_resumes_from_rank_0s_choice_or_the_group_fails(
    shared: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, _ = shared
    step2, step3 = step_dirname(2), step_dirname(3)

    def copy(name: str, drop: str | None = None) -> str:
        target = tmp_path / name
        shutil.copytree(root, target)
        if drop:
            shutil.rmtree(target / drop)
        return str(target)

    # good: rank 0 has step 2 only, rank 1 steps 2 and 3 -> both resume from step 2
    good = [copy("good0", drop=step3), copy("good1")]
    # bad: rank 0 has 2 and 3, rank 1 lacks 3 -> the group fails naming rank 1's step 3
    bad = [copy("bad0"), copy("bad1", drop=step3)]
    # stray temporary files of an interrupted save, each removed by the rank that writes it
    strays = [
        Path(bad[0], step3, "shard_tp00_pp000.tmp999"),
        Path(bad[0], step3, "meta.tmp999"),
        Path(bad[1], step2, "shard_tp01_pp000.tmp999"),
    ]
    for p in strays:
        p.write_text("partial")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LaunchError) as info:
        launch(
            checkpoint_scenarios.per_node_resume,
            world_size=2,
            kwargs={"good_roots": good, "bad_roots": bad, "out_dir": str(out)},
            timeout_s=400,
        )
    missing = str(Path(bad[1], step3))
    text = str(info.value)
    assert "CheckpointUnreadableError" in text and missing in text and "step 3" in text
    goods = [json.loads((out / f"good{r}.json").read_text()) for r in (0, 1)]
    assert [g["resumed"] for g in goods] == [str(Path(good[r], step2)) for r in (0, 1)]
    assert [g["step"] for g in goods] == [2, 2]
    assert goods[0]["loss"] == pytest.approx(goods[1]["loss"], rel=1e-6)
    bads = [json.loads((out / f"bad{r}.json").read_text()) for r in (0, 1)]
    for b in bads:  # raised on both ranks, naming rank 1's missing step
        assert b["type"] == "CheckpointUnreadableError"
        assert (b["path"], b["step"], b["rank"], b["failed_ranks"]) == (missing, 3, 1, [1])
        assert b["node"] == socket.gethostname() and b["node"] in b["message"]
        assert missing in b["message"]
    assert not any(p.exists() for p in strays)


def test_spec_keep_checkpoints_parses_and_reaches_the_pruner() -> None:
    import tgapi

    spec = tgapi.parse_spec({"training": {"keepCheckpoints": 2}}, local=True)
    assert spec.training.keep_checkpoints == 2 and ckpt.keep_checkpoints(spec) == 2
    with pytest.raises(tgapi.SpecErrors, match=r"spec\.training\.keepCheckpoints"):
        tgapi.parse_spec({"training": {"keepCheckpoints": -1}}, local=True)


@pytest.mark.megatron
def test_spec_keep_checkpoints_bounds_the_disk(tmp_path: Path) -> None:
    """spec.training.keepCheckpoints 2 (no environment variable), a save after each of 4 steps
    by one gloo rank: the directory holds the newest two, and its bytes stop growing after the
    second save (measured after each save)."""
    root = tmp_path / "ck"
    (r,) = launch(
        checkpoint_scenarios.save_with_spec_keep, world_size=1,
        kwargs={"root": str(root), "steps": 4, "keep": 2}, timeout_s=300,
    )
    names = [step_dirname(s) for s in (1, 2, 3, 4)]
    assert r["left"] == [names[:1], names[:2], names[1:3], names[2:4]]
    one, two, three, four = r["sizes"]
    assert two > 1.9 * one and abs(three - two) < 0.05 * two and abs(four - two) < 0.05 * two
