"""Training-step benchmark: the Megatron trainer run directly by torch.distributed processes.

The *direct* half (this file) spawns ``world_size`` processes torchrun-style (no Ray),
each drives a ``TrainEngine`` through warm-up and timed steps on deterministic random
batches, and reports the median step time, tokens/s, MFU (GPU: against a bf16 matmul
measured on the same card) and peak memory. The *group* half (the lead's: the same spec
through a detached TrainerGroup) should time the same batches
(``tgruntime.trainer.steptime.bench_batch``) and call :func:`compare`.

    python bench/bench_step.py --preset cpu-small --tp 2 --steps 10          # CPU, gloo
    python bench/bench_step.py --preset seed --device cuda --json out.json   # one H200

Library use: ``run_direct(spec, steps, warmup) -> dict``, ``compare(direct, group)``,
``format_table(rows)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import tgapi
from tgapi import TrainerGroupSpec
from tgruntime.trainer.launch import launch
from tgruntime.trainer.steptime import flops_per_step, summarize

# Model/batch shapes (camelCase, as in a TrainerGroup's spec).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": {
            "vocabSize": 128,
            "hiddenSize": 64,
            "numLayers": 2,
            "numAttentionHeads": 4,
            "ffnHiddenSize": 128,
            "maxSequenceLength": 32,
        },
        "training": {"batchSize": 4, "sequenceLength": 32},
    },
    "cpu-small": {
        "model": {
            "vocabSize": 256,
            "hiddenSize": 256,
            "numLayers": 4,
            "numAttentionHeads": 8,
            "ffnHiddenSize": 688,
            "maxSequenceLength": 256,
        },
        "training": {"batchSize": 8, "sequenceLength": 256},
    },
    # The seed's Llama shape (issue 8's reference: ~358 ms/step on one H200 with SDPA).
    "seed": {
        "model": {
            "vocabSize": 256,
            "hiddenSize": 2048,
            "numLayers": 24,
            "numAttentionHeads": 16,
            "ffnHiddenSize": 5504,
            "maxSequenceLength": 1024,
        },
        "training": {"batchSize": 16, "sequenceLength": 1024},
    },
    # A shape that fills one H200 (~5 B parameters with fp32 main params and Adam state).
    "large": {
        "model": {
            "vocabSize": 32000,
            "hiddenSize": 4096,
            "numLayers": 24,
            "numAttentionHeads": 32,
            "ffnHiddenSize": 11008,
            "maxSequenceLength": 4096,
        },
        "training": {"batchSize": 2, "sequenceLength": 4096},
    },
}


def preset_spec(
    name: str, *, gpu: bool, tp: int = 1, pp: int = 1, world: int | None = None, lr: float = 1e-4
) -> TrainerGroupSpec:
    """A spec for a preset shape on ``world`` processes (default tp x pp)."""
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    shape = PRESETS[name]
    return tgapi.parse_spec(
        {
            "workers": {"useGpu": gpu, "processesPerNode": [world or tp * pp]},
            "parallelism": {"tensor": tp, "pipeline": pp},
            "model": {**shape["model"], "dtype": "bfloat16"},
            "optimizer": {"lr": lr, "clipGrad": 1.0, "weightDecay": 0.01},
            "training": dict(shape["training"]),
        },
        local=True,
    )


def _direct_rank(
    *, spec_wire: dict[str, Any], steps: int, warmup: int, device: str | None, peak: bool
) -> dict[str, Any]:
    """One rank of the direct path (runs in a spawned process)."""
    warnings.filterwarnings("ignore")
    import torch

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.steptime import matmul_tflops, time_engine_steps

    spec = tgapi.parse_spec(spec_wire, local=True)
    if device != "cuda":  # share the cores between the ranks instead of oversubscribing
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    engine = TrainEngine.create(spec=spec, device=device)
    try:
        out = time_engine_steps(engine, steps=steps, warmup=warmup)
    finally:
        engine.shutdown()
    if peak and engine.settings.on_gpu and out["mesh"]["rank"] == 0:
        out["matmul_tflops"] = matmul_tflops()
    return out


def run_direct(
    spec: TrainerGroupSpec,
    steps: int = 20,
    warmup: int = 3,
    *,
    device: str | None = None,
    measure_peak: bool = True,
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Time ``steps`` training steps (after ``warmup``) of ``spec`` without Ray.

    ``spec.world_size`` processes are spawned on this machine (one GPU each on a GPU
    machine). Returns the summary :func:`format_table` prints and :func:`compare` reads.
    """
    ranks = launch(
        _direct_rank,
        world_size=spec.world_size,
        kwargs={
            "spec_wire": tgapi.to_wire(spec),
            "steps": steps,
            "warmup": warmup,
            "device": device,
            "peak": measure_peak,
        },
        timeout_s=timeout_s,
    )
    return summarize_ranks(spec, ranks, path="direct", steps=steps, warmup=warmup)


def summarize_ranks(
    spec: TrainerGroupSpec, ranks: list[dict[str, Any]], *, path: str, steps: int, warmup: int
) -> dict[str, Any]:
    """Fold per-rank measurements into one row (a step lasts as long as its slowest rank)."""
    step_s = [max(r["engine_step_s"][i] for r in ranks) for i in range(steps)]
    loop_s = [max(r["loop_step_s"][i] for r in ranks) for i in range(steps)]
    mesh = ranks[0]["mesh"]
    stats = summarize(step_s)
    tokens = spec.training.batch_size * spec.training.sequence_length
    flops = flops_per_step(spec)
    row: dict[str, Any] = {
        "path": path,
        "world_size": len(ranks),
        "tp": mesh["tp_size"],
        "pp": mesh["pp_size"],
        "dp": mesh["dp_size"],
        "device": mesh["device"].split(":")[0],
        "dtype": mesh["dtype"],
        "model": tgapi.to_wire(spec.model),
        "batch": [spec.training.batch_size, spec.training.sequence_length],
        "parameters": sum(r["mesh"]["parameters"] for r in ranks if r["mesh"]["dp_rank"] == 0),
        "steps": steps,
        "warmup": warmup,
        "step_s": stats,
        "loop_step_s": summarize(loop_s),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / stats["median"],
        "flops_per_step": flops,
        "achieved_tflops": flops / stats["median"] / 1e12,
        "first_loss": ranks[0]["losses"][0],
        "final_loss": ranks[0]["losses"][-1],
    }
    peaks = [r["peak_memory_gib"] for r in ranks if "peak_memory_gib" in r]
    if peaks:
        row["peak_memory_gib"] = max(peaks)
        row["gpu_name"] = ranks[0].get("gpu_name")
    rates = [r["matmul_tflops"] for r in ranks if "matmul_tflops" in r]
    if rates:
        row["matmul_tflops"] = statistics.median(rates)
        row["mfu"] = row["achieved_tflops"] / (row["matmul_tflops"] * row["world_size"])
    return row


def compare(direct: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
    """Group path against direct path: throughput ratio (1.0 = no cost; target >= 0.98)."""
    d, g = direct["step_s"]["median"], group["step_s"]["median"]
    return {
        "direct_step_s": d,
        "group_step_s": g,
        "ratio": d / g,
        "overhead_ms": (g - d) * 1e3,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [
        "path",
        "shape",
        "world",
        "tp/pp/dp",
        "device",
        "dtype",
        "median ms",
        "p10-p90 ms",
        "tokens/s",
        "TFLOP/s",
        "MFU",
        "peak GiB",
        "loss first->last",
    ]
    lines = []
    for r in rows:
        m = r["model"]
        s = r["step_s"]
        lines.append(
            [
                r["path"],
                f"h{m['hiddenSize']} L{m['numLayers']} V{m['vocabSize']} "
                f"{r['batch'][0]}x{r['batch'][1]}",
                str(r["world_size"]),
                f"{r['tp']}/{r['pp']}/{r['dp']}",
                r["device"],
                r["dtype"],
                f"{s['median'] * 1e3:.1f}",
                f"{s['p10'] * 1e3:.1f}-{s['p90'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['achieved_tflops']:.2f}",
                f"{r['mfu']:.3f}" if "mfu" in r else "-",
                f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-",
                f"{r['first_loss']:.3f}->{r['final_loss']:.3f}",
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
        + [fmt.format(*ln) for ln in lines]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    p.add_argument(
        "--spec",
        type=Path,
        help="a TrainerGroup YAML (its model/parallelism/batch) instead of a preset",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--world", type=int, help="processes (default tp x pp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.spec:
        spec = tgapi.load_file(args.spec, local=True).spec
    else:
        spec = preset_spec(
            args.preset, gpu=device == "cuda", tp=args.tp, pp=args.pp, world=args.world
        )
    row = run_direct(spec, args.steps, args.warmup, device=device)
    print(format_table([row]))
    if args.json:
        args.json.write_text(json.dumps({"direct": row}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
