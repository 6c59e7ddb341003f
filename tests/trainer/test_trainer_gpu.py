"""The trainer on a GPU (NCCL, bf16, RoPE, megatron's schedule/DDP/optimizer); skipped
without CUDA."""

from __future__ import annotations

import gc
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.trainer import scenarios

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def test_gpu_bf16_trains_and_resumes(tmp_path: Path) -> None:
    from tgruntime.trainer.launch import launch

    (run,) = launch(
        scenarios.gpu_train_and_resume,
        world_size=1,
        kwargs={"checkpoint_dir": str(tmp_path)},
        timeout_s=300,
    )
    mesh = run["mesh"]
    assert (mesh["backend"], mesh["dtype"], mesh["position_embedding"]) == (
        "nccl",
        "bfloat16",
        "rope",
    )
    losses = run["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert run["loaded"] == 3
    # bf16 kernels may reorder reductions: close, not bitwise
    assert run["resumed"] == pytest.approx(losses[3:], rel=2e-2), (run["resumed"], losses)


def test_gpu_warm_up_compiles_and_leaves_the_engine_as_it_was() -> None:
    from tests.trainer import warm_up_scenarios
    from tgruntime.trainer.launch import launch

    (blob,) = launch(
        warm_up_scenarios.warm_up_suite, world_size=1, kwargs={"gpu": True}, timeout_s=300
    )
    run = torch.load(io.BytesIO(blob), weights_only=False)
    assert run["wanted"], "the compiled fusions are on on a GPU: init_model warms up"
    assert run["params_equal"] and run["step_equal"] and run["rng_equal"], run
    assert run["optim_tensors"] > 0 and run["optim_equal"], run
    # the same gradient again (bf16, kernels compiled for dynamic shapes since: close)
    assert run["grads_max_diff"] < 1e-2, run


def _gpu_engine_run(spec: Any, lora: Any, data: list[torch.Tensor]) -> dict[str, Any]:
    """3 steps on one batch (peak memory above what was allocated before, step times); a
    LoRA engine then checkpoints and takes 2 steps on other batches."""
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.lora import adapter_parameters, optimizer_state_bytes

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    engine = TrainEngine.create(spec=spec, lora=lora)
    try:
        module = engine.state.module
        base = [p.detach().clone() for p in module.parameters()] if lora else []
        base_bytes = sum(t.numel() * t.element_size() for t in base)
        steps = [engine.train_step(data[0]) for _ in range(3)]
        run: dict[str, Any] = {
            "losses": [s.loss for s in steps],
            "step_ms": [1e3 * s.step_time_s for s in steps],
            "peak_bytes": torch.cuda.max_memory_allocated() - baseline - base_bytes,
            "optimizer_state_bytes": optimizer_state_bytes(engine.state.optimizer),
            "mesh": engine.mesh(),
        }
        if lora is not None:
            assert engine.adapters is not None
            trainable = adapter_parameters(engine.adapters)
            inner = getattr(engine.state.optimizer, "optimizer", None)
            run["base_equal"] = all(
                torch.equal(a, p) for a, p in zip(base, module.parameters(), strict=True)
            )
            run["state_is_adapters"] = inner is not None and {id(p) for p in inner.state} == {
                id(p) for p in trainable
            }
            engine.save_checkpoint()
            run["next_losses"] = [engine.train_step(b).loss for b in data[1:3]]
        return run
    finally:
        engine.shutdown()


def gpu_lora_against_full(*, checkpoint_dir: str) -> dict[str, Any]:
    """One GPU, bf16: a full-weight engine and a LoRA engine (rank 16) on the same model,
    then the LoRA checkpoint loaded by a new engine."""
    scenarios._quiet()
    import tgapi
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.lora import LoraSettings
    from tgruntime.trainer.settings import resolve_settings

    spec = tgapi.parse_spec(
        {
            "workers": {"useGpu": True, "processesPerNode": [1]},
            "model": {
                "vocabSize": 512,
                "hiddenSize": 1024,
                "numLayers": 8,
                "numAttentionHeads": 16,
                "numQueryGroups": 4,
                "ffnHiddenSize": 2816,
                "maxSequenceLength": 256,
                "positionEmbedding": "rope",
            },
            "optimizer": {"lr": 1e-3},
            "training": {"batchSize": 8, "sequenceLength": 256, "checkpointDir": checkpoint_dir},
        },
        local=True,
    )
    init_process_group(resolve_settings(spec))
    data = [
        torch.randint(0, 512, (8, 256), generator=torch.Generator().manual_seed(s))
        for s in range(3)
    ]
    settings = LoraSettings(rank=16, alpha=32.0)
    try:
        out: dict[str, Any] = {
            "full": _gpu_engine_run(spec, None, data),
            "lora": _gpu_engine_run(spec, settings, data),
        }
        other = TrainEngine.create(spec=spec, lora=settings)
        try:
            out["loaded"] = other.load_latest_checkpoint()
            out["resumed"] = [other.train_step(b).loss for b in data[1:3]]
        finally:
            other.shutdown()
        return out
    finally:
        dist.destroy_process_group()


def test_gpu_lora_trains_adapters_only_and_resumes(tmp_path: Path) -> None:
    from tgruntime.trainer.launch import launch

    (run,) = launch(
        gpu_lora_against_full,
        world_size=1,
        kwargs={"checkpoint_dir": str(tmp_path)},
        timeout_s=300,
    )
    full, lora = run["full"], run["lora"]
    print(
        f"\nfull: peak {full['peak_bytes'] / 2**20:.0f} MiB, Adam state "
        f"{full['optimizer_state_bytes'] / 2**20:.1f} MiB, steps {full['step_ms']} ms"
        f"\nlora r16: peak {lora['peak_bytes'] / 2**20:.0f} MiB, Adam state "
        f"{lora['optimizer_state_bytes'] / 2**20:.1f} MiB, steps {lora['step_ms']} ms, "
        f"{lora['mesh']['adapter_parameters']} adapter parameters of {lora['mesh']['parameters']}"
    )
    assert all(math.isfinite(x) for x in full["losses"] + lora["losses"])
    assert lora["base_equal"] and lora["state_is_adapters"]
    assert lora["losses"][-1] < lora["losses"][0] and full["losses"][-1] < full["losses"][0]
    # B starts at zero: the first step sees the base model, as the full-weight run does
    assert lora["losses"][0] == pytest.approx(full["losses"][0], rel=1e-3)
    assert lora["optimizer_state_bytes"] < full["optimizer_state_bytes"] / 4
    assert lora["peak_bytes"] < full["peak_bytes"]
    assert run["loaded"] == 3
    assert run["resumed"] == pytest.approx(lora["next_losses"], rel=2e-2)
