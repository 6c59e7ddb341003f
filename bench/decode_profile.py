"""Where a decode step's device time goes: the sampler's kernels, by total CUDA time.

One process, no Ray: the preset's ``TrainEngine`` (random weights) and its ``Sampler``
without CUDA graphs (the same kernels a graph replays), ``--batch`` prompts of ``--prompt``
tokens, ``--new`` tokens; the second call is profiled with ``torch.profiler``. Prints the
kernels by total device time (per decode step) and saves them as JSON.

    python bench/decode_profile.py --preset seed --batch 32 --json /tmp/out/profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
import tgapi


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.sampling import Sampler, SamplingParams

    wire = tgapi.to_wire(bench_step.preset_spec(args.preset, gpu=True))
    wire["model"]["positionEmbedding"] = "rope"
    engine = TrainEngine.create(spec=tgapi.parse_spec(wire, local=True), device="cuda")
    sampler = Sampler(engine.state.module, cuda_graphs=False)
    vocab = int(wire["model"]["vocabSize"])
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.batch, args.prompt), generator=gen).tolist()
    params = SamplingParams.build(max_tokens=args.new, seed=1, vocab_size=vocab)
    sampler.generate(prompts, params)  # compile, allocate
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sampler.generate(prompts, params)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = float(getattr(event, "device_time_total", 0.0) or 0.0)
        if device_us <= 0:
            continue
        rows.append({"kernel": event.key, "calls": event.count, "device_us": device_us})
    rows.sort(key=lambda r: -r["device_us"])
    steps = args.new
    total = sum(r["device_us"] for r in rows)
    engine.shutdown()
    return {
        "preset": args.preset,
        "batch": args.batch,
        "decode": "modules"
        if sampler.decoder.lean is None
        else ("lean, compiled" if sampler.decoder.lean.compiled else "lean"),
        "steps": steps,
        "device_us_per_step": total / steps,
        "kernels": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="seed", choices=sorted(bench_step.PRESETS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default="")
    args = p.parse_args()
    res = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    steps = res["steps"]
    print(
        f"{res['preset']} batch {res['batch']} ({res['decode']}): "
        f"{res['device_us_per_step']:.0f} us of kernels per step (prefill included)"
    )
    print("| kernel | calls/step | us/step |")
    print("|---|---|---|")
    for r in res["kernels"][: args.top]:
        print(f"| {r['kernel'][:90]} | {r['calls'] / steps:.1f} | {r['device_us'] / steps:.1f} |")


if __name__ == "__main__":
    main()
