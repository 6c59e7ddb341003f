"""Step-time measurement shared by the direct and the group halves of the step benchmark.

Same batches (deterministic random tokens per step), same warm-up rule, same statistics and
the same FLOP count on both paths, so their ratio compares only the path. The FLOP count
is megatron's convention (dense matmuls, full - not causal-halved - attention, x3 for
forward + backward), which is how the reference figure (~358 ms/step, MFU ~0.47 on one
H200 for the seed shape) was computed.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import torch

from tgapi import TrainerGroupSpec

if TYPE_CHECKING:
    from tgruntime.trainer.engine import TrainEngine

__all__ = [
    "bench_batch",
    "flops_per_step",
    "matmul_tflops",
    "summarize",
    "time_engine_steps",
]


def bench_batch(
    spec: TrainerGroupSpec, step: int, *, dp_rank: int = 0, dp_size: int = 1
) -> torch.Tensor:
    """Step ``step``'s global batch (random tokens), or one data-parallel rank's rows of it."""
    t = spec.training
    g = torch.Generator().manual_seed(10_000 + step)
    batch = torch.randint(0, spec.model.vocab_size, (t.batch_size, t.sequence_length), generator=g)
    rows = t.batch_size // dp_size
    return batch[dp_rank * rows : (dp_rank + 1) * rows]


def flops_per_step(spec: TrainerGroupSpec) -> float:
    """Training FLOPs of one global step (megatron's formula)."""
    m, t = spec.model, spec.training
    h, s = m.hidden_size, t.sequence_length
    head_dim = m.head_dim or h // m.num_attention_heads  # Qwen3 may set its own
    q = m.num_attention_heads * head_dim
    kv = (m.num_query_groups or m.num_attention_heads) * head_dim
    mlp_mats = 3 if m.activation == "swiglu" else 2
    per_token_layer = (
        2 * h * (q + 2 * kv) + 2 * 2 * s * q + 2 * q * h + 2 * h * m.ffn_hidden_size * mlp_mats
    )
    per_token = m.num_layers * per_token_layer + 2 * h * m.vocab_size
    return float(3.0 * per_token * t.batch_size * s)


def summarize(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    n = len(ordered)
    return {
        "median": statistics.median(ordered),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p10": ordered[int(0.1 * (n - 1))],
        "p90": ordered[round(0.9 * (n - 1))],
        "n": float(n),
    }


def time_engine_steps(engine: TrainEngine, *, steps: int, warmup: int) -> dict[str, Any]:
    """Run ``warmup`` + ``steps`` steps on this rank; per-step engine and loop times."""
    mesh = engine.mesh_info
    spec = engine.spec
    if engine.settings.on_gpu:
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine_times, loop_times, losses = [], [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        result = engine.train_step(bench_batch(spec, i, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size))
        loop = time.perf_counter() - start
        losses.append(result.loss)
        if i >= warmup:
            engine_times.append(result.step_time_s)
            loop_times.append(loop)
    out: dict[str, Any] = {
        "mesh": engine.mesh(),
        "engine_step_s": engine_times,
        "loop_step_s": loop_times,
        "losses": losses,
        "tokens_per_step": result.tokens,
    }
    if engine.settings.on_gpu:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
        out["gpu_name"] = torch.cuda.get_device_name(engine.device)
    return out


def matmul_tflops(*, size: int = 8192, repeats: int = 10, warmup: int = 3) -> float:
    """Measured dense bf16 matrix-product rate of this GPU (the MFU denominator)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ b
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    rates = []
    for _ in range(repeats):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        rates.append(2 * size**3 / (start.elapsed_time(end) / 1e3) / 1e12)
    return float(statistics.median(rates))
