"""The LoRA option of ``TrainEngine`` and ``MegatronTrainer`` (CPU, gloo, TP=2, tiny Llama).

One launch of two processes (``tgruntime.trainer.launch``, as test_lora.py) runs, in order:

* refusals of ``TrainEngine.create(lora=...)`` before anything is built;
* a full-weight engine and a rank-0 LoRA engine (two steps each): today's behaviour, the
  full optimizer over every base parameter;
* test_lora.py's path: a full-weight engine with the adapters swapped in by hand
  (``inject_lora`` + ``build_adapter_training_state``), two steps;
* ``TrainEngine.create(lora=...)``: two steps (base bit-identical, adapters moved, Adam state
  for the adapter parameters only), a checkpoint, then two more steps;
* a new LoRA engine (another model seed and adapter seed) that loads the checkpoint and
  takes the same two steps; the refused cross loads (full <-> LoRA);
* ``MegatronTrainer(spec_json)`` with ``spec.lora``, without Ray: ``init_model`` resumes
  from the checkpoint, ``train_model`` gives the same next loss, ``export_lora`` writes PEFT files,
  ``sample`` works (tested in depth by test_lora_sampling.py).

Nothing is downloaded: the model is megatron's, built from the seed.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.trainer import lora_scenarios
from tests.trainer.scenarios import _quiet, fixed_batch, tiny_spec

pytestmark = pytest.mark.megatron

MODEL = lora_scenarios.MODEL  # RoPE, 2 key/value groups: a Llama LoRA can adapt
TP = 2
OTHER_SEED = 1234  # the model seed of the engine that loads the checkpoint


# -- per-rank body (spawned) ----------------------------------------------------------------
def _batches() -> list[torch.Tensor]:
    return [fixed_batch(seed) for seed in range(4)]


def _optimizer_facts(engine: Any) -> dict[str, Any]:
    """What the engine's optimizer holds: its parameters and the tensors of Adam's state."""
    from tgruntime.trainer.lora import optimizer_state_bytes

    params = [p for g in engine.state.optimizer.param_groups for p in g["params"]]
    inner = getattr(engine.state.optimizer, "optimizer", engine.state.optimizer)
    return {
        "params": len(params),
        "param_ids": {id(p) for p in params},
        "state_entries": len(inner.state),
        "state_ids": {id(p) for p in inner.state},
        "state_bytes": optimizer_state_bytes(engine.state.optimizer),
    }


def _full_run(spec: Any, lora: Any, ckpt: Path | None) -> dict[str, Any]:
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.optim import TrainingState

    engine = TrainEngine.create(spec=spec, lora=lora)
    try:
        module = engine.state.module
        base_ids = {id(p) for p in module.parameters()}
        before = _optimizer_facts(engine)
        losses = [engine.train_step(b).loss for b in _batches()[:2]]
        after = _optimizer_facts(engine)
        if ckpt is not None:
            engine.save_checkpoint(ckpt)
        return {
            "losses": losses,
            "lora": engine.lora is not None or engine.adapters is not None,
            "state_type": type(engine.state).__name__,
            "is_plain_state": type(engine.state) is TrainingState,
            "base_params": len(base_ids),
            "optimizer_is_base": before["param_ids"] == base_ids,
            "optimizer_params": before["params"],
            "state_entries_after": after["state_entries"],
            "state_is_base": after["state_ids"] == base_ids,
            "mesh_keys": sorted(engine.mesh()),
        }
    finally:
        engine.shutdown()


def _swapped_run(spec: Any, settings: Any) -> dict[str, Any]:
    """test_lora.py's path: the full-weight engine, its state replaced by the adapters'."""
    from tgruntime.trainer import TrainEngine, lora
    from tgruntime.trainer.hf_weights import LlamaShape

    engine = TrainEngine.create(spec=spec)
    try:
        module = engine.state.module
        shape = LlamaShape.from_model_spec(spec.model, position_embedding="rope")
        adapters = lora.inject_lora(module, settings=settings, shape=shape)
        engine.state = lora.build_adapter_training_state(
            module, adapters=adapters, config=module.config, spec=spec.optimizer
        )
        return {"losses": [engine.train_step(b).loss for b in _batches()[:2]]}
    finally:
        engine.shutdown()


def _lora_run(spec: Any, settings: Any, ckpt: Path) -> dict[str, Any]:
    from tgruntime.trainer import TrainEngine, lora
    from tgruntime.trainer.checkpoint import read_meta, read_shard

    engine = TrainEngine.create(spec=spec, lora=settings)
    try:
        module = engine.state.module
        adapters = engine.adapters
        assert adapters is not None
        trainable = lora.adapter_parameters(adapters)
        base = {n: p.detach().clone() for n, p in module.named_parameters()}
        start = {n: p.detach().clone() for n, p in adapters.named_parameters()}
        before = _optimizer_facts(engine)
        steps = [engine.train_step(b) for b in _batches()[:2]]
        after = _optimizer_facts(engine)
        params = dict(module.named_parameters())
        moved = {
            n: float((p.detach() - start[n]).abs().max()) for n, p in adapters.named_parameters()
        }
        out: dict[str, Any] = {
            "losses": [s.loss for s in steps],
            "grad_norms": [s.grad_norm for s in steps],
            "state_type": type(engine.state).__name__,
            "optimizer_type": type(engine.state.optimizer).__name__,
            "model_is_bare": engine.state.model is module,
            "base_equal": all(torch.equal(params[n], t) for n, t in base.items()),
            "base_requires_grad": any(p.requires_grad for p in module.parameters()),
            "base_grads": sum(p.grad is not None for p in module.parameters()),
            "base_params": len(base),
            "base_elements": sum(t.numel() for t in base.values()),
            "adapter_tensors": len(trainable),
            "adapter_elements": sum(p.numel() for p in trainable),
            "adapters_moved": moved,
            "optimizer_params_before": before["params"],
            "optimizer_is_adapters": before["param_ids"] == {id(p) for p in trainable},
            "state_entries_before": before["state_entries"],
            "state_entries_after": after["state_entries"],
            "state_is_adapters": after["state_ids"] == {id(p) for p in trainable},
            "state_bytes": after["state_bytes"],
            "adam_bytes_adapters": lora.adam_state_bytes(trainable),
            "adam_bytes_full": lora.adam_state_bytes(module.parameters()),
            "mesh": engine.mesh(),
        }
        out["ckpt_path"] = engine.save_checkpoint(ckpt)
        shard = read_shard(ckpt, engine.mesh_info, map_location=torch.device("cpu"))
        out["shard_keys"] = sorted(shard)
        out["shard_optimizer_entries"] = len(shard["optimizer"]["state"])
        out["shard_adapters"] = len(shard["adapters"])
        out["meta_lora"] = read_meta(ckpt).get("lora")
        out["next_losses"] = [engine.train_step(b).loss for b in _batches()[2:]]
        out["final_adapters"] = {n: p.detach().clone() for n, p in adapters.named_parameters()}
        return out
    finally:
        engine.shutdown()


def _loaded_run(spec: Any, settings: Any, ckpt: Path, full_ckpt: Path) -> dict[str, Any]:
    """A new LoRA engine (other model seed, other adapter seed) loads the checkpoint."""
    from tgruntime.trainer import TrainEngine

    engine = TrainEngine.create(spec=spec, lora=settings)
    try:
        out: dict[str, Any] = {}
        try:
            engine.load_checkpoint(full_ckpt)
        except ValueError as exc:
            out["full_into_lora"] = str(exc)
        out["loaded_step"] = engine.load_checkpoint(ckpt)
        out["next_losses"] = [engine.train_step(b).loss for b in _batches()[2:]]
        out["step"] = engine.step
        assert engine.adapters is not None
        out["final_adapters"] = {
            n: p.detach().clone() for n, p in engine.adapters.named_parameters()
        }
        return out
    finally:
        engine.shutdown()


def _load_refused(spec: Any, path: Path) -> str:
    """A full-weight engine refuses a LoRA checkpoint (the message)."""
    from tgruntime.trainer import TrainEngine

    engine = TrainEngine.create(spec=spec)
    try:
        engine.load_checkpoint(path)
    except ValueError as exc:
        return str(exc)
    finally:
        engine.shutdown()
    raise AssertionError(f"{path} loaded into a full-weight engine")


def _refusals(spec: Any) -> dict[str, Any]:
    """Bad LoRA settings are refused by ``create`` before anything is built."""
    from megatron.core import parallel_state

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.lora import LoraSettings

    out: dict[str, Any] = {}
    learned = tiny_spec(tp=TP, **{**MODEL, "positionEmbedding": "learned_absolute"})
    for case, case_spec, settings in (
        ("rank", spec, LoraSettings(rank=65)),
        ("positions", learned, LoraSettings(rank=4)),
    ):
        try:
            TrainEngine.create(spec=case_spec, lora=settings).shutdown()
        except ValueError as exc:
            out[case] = str(exc)
        out[f"{case}_left_parallel_state"] = parallel_state.model_parallel_is_initialized()
    return out


def _worker_run(spec_json: str, lora_json: str | None, peft_dir: Path) -> dict[str, Any]:
    """``MegatronTrainer`` driven directly (no Ray): resume, one step, PEFT export, sampling."""
    from tgruntime.controller import DataProto
    from tgruntime.trainer.worker import MegatronTrainer

    worker = MegatronTrainer(spec_json, lora_json)
    try:
        mesh = worker.init_model()
        step = worker.train_model(DataProto.from_dict(tensors={"input_ids": _batches()[2]}))
        out: dict[str, Any] = {
            "mesh": mesh,
            "loss": step.meta_info["loss"],
            "step": step.meta_info["step"],
            "export": worker.export_lora(str(peft_dir)),
        }
        out["sample"] = worker.sample([[1, 2, 3]], max_tokens=2, seed=0)  # test_lora_sampling
        return out
    finally:
        worker.shutdown()


def engine_suite(*, out_dir: str) -> bytes:
    _quiet()
    import tgapi
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.lora import LoraSettings
    from tgruntime.trainer.settings import resolve_settings

    root = Path(out_dir)
    init_process_group(resolve_settings(tiny_spec(**MODEL)))
    try:
        spec = tiny_spec(tp=TP, **MODEL)
        settings = lora_scenarios.settings()
        rank0 = LoraSettings(rank=0, train_attn=False, train_mlp=False, train_unembed=False)
        result: dict[str, Any] = {"refusals": _refusals(spec)}
        result["full"] = _full_run(spec, None, root / "full")
        result["rank0"] = _full_run(spec, rank0, None)
        result["swapped"] = _swapped_run(spec, settings)
        lora_dir = root / "runs"
        result["lora"] = _lora_run(
            tiny_spec(tp=TP, checkpoint_dir=str(lora_dir), **MODEL), settings, lora_dir / "step2"
        )
        result["lora_into_full"] = _load_refused(spec, lora_dir / "step2")
        other = tiny_spec(tp=TP, **{**MODEL, "seed": OTHER_SEED})
        result["loaded"] = _loaded_run(
            other, dataclasses.replace(settings, seed=99), lora_dir / "step2", root / "full"
        )
        # the worker takes its LoRA settings from spec.lora, as tgctl and operator groups do
        # (seed 0 there; the checkpoint it resumes holds the adapters, so only rank, alpha and
        # the switches must match)
        wire = tgapi.to_wire(tiny_spec(tp=TP, checkpoint_dir=str(lora_dir), **MODEL))
        wire["lora"] = {"rank": settings.rank, "alpha": settings.alpha}
        result["worker"] = _worker_run(json.dumps(wire), None, root / "peft")
        buffer = io.BytesIO()
        torch.save(result, buffer)
        return buffer.getvalue()
    finally:
        dist.destroy_process_group()


# -- the tests --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tgruntime.trainer.launch import launch

    root = tmp_path_factory.mktemp("lora-engine")
    blobs = launch(engine_suite, world_size=TP, kwargs={"out_dir": str(root)}, timeout_s=400)
    ranks = [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]
    return {"ranks": ranks, "root": root}


def test_lora_engine_moves_only_the_adapters(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        r = rank["lora"]
        assert r["state_type"] == "AdapterTrainingState"
        assert r["optimizer_type"] == "LocalOptimizer" and r["model_is_bare"]  # no DDP
        assert r["base_equal"] is True  # every base tensor bit-identical after two steps
        assert not r["base_requires_grad"] and r["base_grads"] == 0
        moved = r["adapters_moved"]
        # 2 layers x (q, k, v, o, gate, up, down) + lm_head, an A and a B each
        assert len(moved) == r["adapter_tensors"] == 2 * (2 * 7 + 1)
        assert all(m > 0 for m in moved.values()), [n for n, m in moved.items() if m == 0]
        assert all(g > 0 for g in r["grad_norms"])


def test_optimizer_state_exists_for_adapter_parameters_only(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        r = rank["lora"]
        assert r["optimizer_is_adapters"] and r["optimizer_params_before"] == 30
        assert r["state_entries_before"] == 0  # nothing allocated before the first step
        assert r["state_entries_after"] == r["adapter_tensors"] == 30
        assert r["state_is_adapters"]
        assert r["state_bytes"] == r["adam_bytes_adapters"]
        assert r["adam_bytes_adapters"] < r["adam_bytes_full"] / 4
        assert r["adapter_elements"] < r["base_elements"] / 4
        assert r["mesh"]["adapter_parameters"] == r["adapter_elements"]
        assert r["mesh"]["lora"] == lora_scenarios.settings().to_dict()
    # TP=2: a column adapter's B and a row adapter's A are split over the two ranks, the
    # other factor replicated; so one rank holds more than half the model's adapter
    total = lora_scenarios.settings().parameter_count(_shape())
    held = run["ranks"][0]["lora"]["adapter_elements"]
    assert total / 2 < held < total


def _shape() -> Any:
    from tgruntime.trainer.hf_weights import LlamaShape

    return LlamaShape.from_model_spec(tiny_spec(**MODEL).model, position_embedding="rope")


def test_loss_equals_the_swapped_in_adapters_of_test_lora(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        assert rank["lora"]["losses"] == rank["swapped"]["losses"]  # bit for bit
    r0, r1 = (rank["lora"]["losses"] for rank in run["ranks"])
    assert r0 == r1  # tensor-parallel peers agree
    # B starts at zero: the first loss is the base model's, the same as the full-weight run's
    assert run["ranks"][0]["lora"]["losses"][0] == pytest.approx(
        run["ranks"][0]["full"]["losses"][0], abs=1e-6
    )


def test_checkpoint_then_a_new_engine_gives_the_same_next_losses(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        saved, loaded = rank["lora"], rank["loaded"]
        assert loaded["loaded_step"] == 2 and loaded["step"] == 4
        assert loaded["next_losses"] == saved["next_losses"]  # bit for bit, Adam state included
        assert saved["next_losses"][0] != saved["losses"][1]
        for name, value in saved["final_adapters"].items():
            assert torch.equal(loaded["final_adapters"][name], value), name
        assert saved["shard_keys"] == [
            "adapters",
            "lora",
            "mesh",
            "model",
            "optimizer",
            "rng",
            "step",
        ]
        assert saved["shard_adapters"] == 30
        assert saved["shard_optimizer_entries"] == 30  # the adapters' Adam state only
        assert saved["meta_lora"] == lora_scenarios.settings().to_dict()


def test_cross_loads_are_refused(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        assert "is a full-weight checkpoint (no LoRA adapters)" in rank["loaded"]["full_into_lora"]
        assert (
            "holds LoRA adapters (rank 4); this engine trains full weights"
            in (rank["lora_into_full"])
        )


def test_rank_zero_keeps_the_full_weight_optimizer(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        full, rank0 = rank["full"], rank["rank0"]
        assert rank0["losses"] == full["losses"]
        for r in (full, rank0):
            assert r["lora"] is False and r["is_plain_state"] and r["state_type"] == "TrainingState"
            assert r["optimizer_is_base"] and r["optimizer_params"] == r["base_params"]
            assert r["state_entries_after"] == r["base_params"] and r["state_is_base"]
            assert "lora" not in r["mesh_keys"] and "adapter_parameters" not in r["mesh_keys"]
        assert "lora" in rank["lora"]["mesh"]


def test_bad_settings_are_refused_before_anything_is_built(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        r = rank["refusals"]
        assert "lora.rank 65 is beyond the model's hidden size 64" in r["rank"]
        assert "lora: the adapters follow Hugging Face Llama's layout" in r["positions"]
        assert "RoPE" in r["positions"]
        assert r["rank_left_parallel_state"] is False
        assert r["positions_left_parallel_state"] is False


def test_worker_resumes_trains_and_exports_the_adapters(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        w = rank["worker"]
        assert w["mesh"]["resumed_from"] == rank["lora"]["ckpt_path"]
        assert w["mesh"]["lora"] == {**lora_scenarios.settings().to_dict(), "seed": 0}
        assert w["step"] == 3
        assert w["loss"] == rank["lora"]["next_losses"][0]
        assert w["export"]["tensors"] == 30
        assert len(w["sample"][0]["sequences"][0]["tokens"]) == 2
    peft_dir = run["root"] / "peft"
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["r"] == lora_scenarios.RANK and config["lora_alpha"] == lora_scenarios.ALPHA
    assert (peft_dir / "adapter_model.safetensors").is_file()


def test_worker_lora_argument() -> None:
    from tgruntime.trainer.worker import _parse_lora

    assert _parse_lora(None) is None and _parse_lora("null") is None
    assert (
        _parse_lora(
            json.dumps({"rank": 0, "train_attn": False, "train_mlp": False, "train_unembed": False})
        )
        is None
    )
    parsed = _parse_lora(json.dumps({"rank": 8, "alpha": 16}))
    assert parsed is not None and parsed.rank == 8 and parsed.scaling == 2.0
    with pytest.raises(ValueError, match="lora: unknown field 'rnk'"):
        _parse_lora(json.dumps({"rnk": 8}))
    with pytest.raises(ValueError, match="must be a JSON object"):
        _parse_lora("[8]")
