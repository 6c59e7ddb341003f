"""Safe loading (issue 37): a crafted file on the checkpoint volume runs no code in a worker.

A pickle whose ``__reduce__`` would create a marker file is planted where the workers expect
a checkpoint shard, a sampler snapshot, a saved LoRA run and LoRA adapter state, as a bare
pickle (protocols 4 and 2) and inside a ``torch.save`` zip; every load raises
``pickle.UnpicklingError`` naming the file and saying it was refused as unsafe, and the
marker never appears. A state
of the kinds our saves hold (megatron-style model and AdamW state after a real step, python,
numpy and torch RNG states) still loads and restores. In-process, no process group.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer import safe_load
from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.lora import runs, state


def _mesh() -> Mesh:
    return Mesh(rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                cp_rank=0, cp_size=1, dp_rank=0, dp_size=1)


class _Payload:
    """Unpickling this would run ``os.system("touch <marker>")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant(target: Path, marker: Path, how: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    evil = {"model": {}, "optimizer": _Payload(marker), "step": 3}
    if how.startswith("pickle"):
        with target.open("wb") as f:
            pickle.dump(evil, f, protocol=2 if how == "pickle2" else pickle.DEFAULT_PROTOCOL)
    else:
        torch.save(evil, target)


def _checkpoint(path: Path) -> Any:
    return ckpt.read_shard(path, _mesh(), map_location=torch.device("cpu"))


def _lora_run(path: Path) -> Any:
    return runs.RunSet._read(object(), path)  # type: ignore[arg-type]  # fails before self


def _adapter_state(path: Path) -> Any:
    return state.load_adapter_state(object(), path)  # type: ignore[arg-type]


KINDS: dict[str, tuple[Callable[[Path], Path], Callable[[Path], Any], str]] = {
    # where the planted file goes, the worker's loader, what the error calls it
    "checkpoint": (lambda p: ckpt.shard_path(p, _mesh()), _checkpoint, "a checkpoint shard"),
    "lora_run": (lambda p: p / "run_tp00_pp000.pt", _lora_run, "a saved LoRA run"),
    "adapter_state": (lambda p: p / "adapter_tp00_pp000.pt", _adapter_state,
                      "LoRA adapter state"),
}


@pytest.fixture
def tp1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP=1, PP=1 layout for the LoRA files' names, without a process group."""
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)


@pytest.mark.usefixtures("tp1")
@pytest.mark.parametrize("how", ["pickle", "pickle2", "torch_save"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path: Path, kind: str, how: str) -> None:
    where, load, what = KINDS[kind]
    marker = tmp_path / "PWNED"
    target = where(tmp_path / "ckpt")
    _plant(target, marker, how)
    with pytest.raises(pickle.UnpicklingError) as info:
        load(tmp_path / "ckpt")
    text = str(info.value)
    assert str(target) in text and f"refused to load it as {what}" in text
    assert "unsafe" in text and "Nothing in it was run" in text
    if how == "pickle":  # protocol 4's framing: refused at its first opcode
        assert "Unsupported operand" in text
    else:  # the global it asked for
        assert "it names posix.system, which is not allowed" in text
    assert not marker.exists()


def test_the_unrestricted_loader_would_have_run_it(tmp_path: Path) -> None:
    """The planted file is a real exploit: ``weights_only=False`` runs it (the control)."""
    marker = tmp_path / "PWNED"
    _plant(tmp_path / "f.pt", marker, "torch_save")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    _plant(tmp_path / "g.pt", marker, "pickle")  # torch unpickles a bare pickle's "header"
    with pytest.raises(RuntimeError, match="magic number"):
        torch.load(tmp_path / "g.pt", weights_only=False)
    assert marker.exists()


def test_a_sampler_snapshot_is_read_safely(tmp_path: Path) -> None:
    """Sampler snapshots (``save_weights_for_sampler``) are shards read by read_shard too."""
    marker = tmp_path / "PWNED"
    _plant(ckpt.shard_path(tmp_path, _mesh()), marker, "torch_save")
    with pytest.raises(pickle.UnpicklingError, match="refused to load it as a checkpoint shard"):
        ckpt.read_shard(tmp_path, _mesh(), map_location=torch.device("cpu"))
    assert not marker.exists()


def test_other_disallowed_globals_are_refused(tmp_path: Path) -> None:
    """Not only callables: an arbitrary class (here a numpy subclass and object arrays'
    builtins) outside the allow-list is refused too."""
    target = tmp_path / "f.pt"
    torch.save({"x": np.ma.masked_array([1, 2])}, target)
    with pytest.raises(pickle.UnpicklingError, match="unsafe"):
        safe_load.load_state(target, what="a checkpoint shard")


def test_a_real_state_still_loads_and_restores(tmp_path: Path) -> None:
    """What our saves hold (a module and AdamW after a step, every RNG state) loads under
    the allow-list, and the RNG streams continue where they were saved."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    payload = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "rng": ckpt.capture_rng(),
        "mesh": _mesh().to_dict(),
        "lora": {"rank": 4, "alpha": 8.0},
    }
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ckpt.write_shard(tmp_path, _mesh(), payload)
    loaded = ckpt.read_shard(tmp_path, _mesh(), map_location=torch.device("cpu"))
    assert loaded["step"] == 7 and loaded["mesh"] == _mesh().to_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["model"][k], v)
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    again.load_state_dict(loaded["optimizer"])
    assert again.param_groups[0]["betas"] == (0.9, 0.95)
    moments = again.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, opt.state_dict()["state"][0]["exp_avg"])
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ckpt.restore_rng(loaded["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_the_allow_list_is_exactly_what_our_rng_state_needs(tmp_path: Path) -> None:
    """Without SAFE_GLOBALS the numpy RNG state is refused; with it, nothing else is added."""
    target = tmp_path / "f.pt"
    torch.save({"numpy": np.random.get_state()}, target)
    with pytest.raises(pickle.UnpicklingError, match="numpy"):
        torch.load(target, weights_only=True)
    assert len(safe_load.SAFE_GLOBALS) == 4
    assert safe_load.load_state(target, what="x")["numpy"][0] == "MT19937"


# -- confinement: no other way to unpickle a file in the runtime ------------------------------
RUNTIME = Path(__file__).resolve().parents[2] / "runtime" / "tgruntime"
UNPICKLERS = re.compile(
    r"torch\.load\(|pickle\.loads?\(|dill\.|joblib\.load|allow_pickle\s*=\s*True"
    r"|dist_checkpointing|torch\.distributed\.checkpoint|FileSystemReader|weights_only\s*=\s*False"
)
# each other hit, and why it reads no file of the checkpoint volume
ALLOWED = {
    "trainer/safe_load.py": "the restricted loader itself (weights_only=True, allow-list)",
    "controller/gcs_view.py": "Ray's own function-table entry from the GCS, not a file",
}


def test_no_other_unpickling_in_the_runtime() -> None:
    """Every unpickling of a file goes through safe_load: no other torch.load, pickle.load,
    weights_only=False, np.load(allow_pickle=True), nor Megatron's or torch's distributed
    checkpointing (both unpickle metadata: torch's .metadata with pickle.load)."""
    hits = sorted(
        f"{path.relative_to(RUNTIME)}:{n}: {line.strip()}"
        for path in RUNTIME.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if UNPICKLERS.search(line) and not line.lstrip().startswith(("#", "``", "*"))
        and str(path.relative_to(RUNTIME)) not in ALLOWED
    )
    assert not hits, "load through tgruntime.trainer.safe_load.load_state instead:\n" + "\n".join(
        hits
    )
    for name in ALLOWED:
        assert UNPICKLERS.search((RUNTIME / name).read_text()), f"{name}: stale ALLOWED entry"


# -- two gloo ranks: a refused shard stops every rank ------------------------------------------
def planted_shard_on_rank_1(*, root: str, marker: str) -> dict[str, Any]:
    """TP=2 (launched): save, plant the payload in rank 1's shard, load (every rank must raise
    CheckpointUnreadableError naming rank 1), then save and load a sound checkpoint."""
    from tests.trainer.scenarios import _quiet, fixed_batch, tiny_spec

    _quiet()
    import torch.distributed as dist

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.checkpoint import CheckpointUnreadableError
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    spec = tiny_spec(tp=2, checkpoint_dir=root)
    init_process_group(resolve_settings(spec))
    out: dict[str, Any] = {}
    try:
        engine = TrainEngine.create(spec=spec)
        try:
            engine.train_step(fixed_batch())
            saved = engine.save_checkpoint()
            if dist.get_rank() == 1:
                _plant(Path(saved) / "shard_tp01_pp000.pt", Path(marker), "torch_save")
            dist.barrier()
            try:
                engine.load_checkpoint(saved)
            except CheckpointUnreadableError as exc:
                out["error"] = {"text": str(exc), "rank": exc.rank, "failed": exc.failed_ranks,
                                "step": exc.step, "path": exc.path}
            again = engine.save_checkpoint(str(Path(root) / "sound"))
            out["loaded_step"] = engine.load_checkpoint(again)
        finally:
            engine.shutdown()
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.megatron
def test_a_refused_shard_stops_every_rank_and_a_sound_one_loads(tmp_path: Path) -> None:
    from tgruntime.trainer.launch import launch

    marker = tmp_path / "PWNED"
    results = launch(
        planted_shard_on_rank_1,
        world_size=2,
        kwargs={"root": str(tmp_path / "ckpt"), "marker": str(marker)},
        timeout_s=300,
    )
    for r in results:
        err = r["error"]
        assert (err["rank"], err["failed"], err["step"]) == (1, [1], 1)
        assert err["path"] == str(tmp_path / "ckpt" / ckpt.step_dirname(1))
        assert "shard_tp01_pp000.pt: refused to load it as a checkpoint shard" in err["text"]
        assert "unsafe" in err["text"] and "Nothing in it was run" in err["text"]
        assert "remove the checkpoint" in err["text"]
        assert r["loaded_step"] == 1
    assert not marker.exists()
