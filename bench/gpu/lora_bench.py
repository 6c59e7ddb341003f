"""LoRA against full-weight training, and many runs on one group, on one GPU (issue 22).

Each case runs in a spawned process of its own (one rank, no Ray), so peak memory is the
case's alone; the cases run one after the other in one invocation, so their ratios are
taken under the same conditions:

- ``full``: ``TrainEngine.create(spec)``, ``steps`` training steps;
- ``lora-rN``: ``TrainEngine.create(spec, lora=rank N)``, the same steps, then ``runs`` runs
  on that group (``lora.runs.RunSet``: the engine's own plus ``runs - 1`` created), stepping
  round robin (switch, step): the aggregate tokens/s of all runs against one run's.

Prints a table and writes JSON.

    python bench/gpu/lora_bench.py --preset seed --rank 32 --runs 4 --steps 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/


def _case(*, spec_wire: dict[str, Any], rank: int, runs: int, steps: int, warmup: int) -> Any:
    warnings.filterwarnings("ignore")
    import torch

    import tgapi
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.lora import LoraSettings, adam_state_bytes, optimizer_state_bytes
    from tgruntime.trainer.lora.runs import RunSet
    from tgruntime.trainer.steptime import bench_batch, time_engine_steps

    spec = tgapi.parse_spec(spec_wire, local=True)
    lora = LoraSettings(rank=rank) if rank > 0 else None
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    engine = TrainEngine.create(spec=spec, lora=lora)
    try:
        built = torch.cuda.memory_allocated() / 2**30 if gpu else 0.0
        one = time_engine_steps(engine, steps=steps, warmup=warmup)
        out: dict[str, Any] = {
            "case": "full" if lora is None else f"lora-r{rank}",
            "parameters": one["mesh"]["parameters"],
            "adapter_parameters": one["mesh"].get("adapter_parameters", 0),
            "memory_after_build_gib": built,
            "peak_memory_gib": one.get("peak_memory_gib", 0.0),
            "optimizer_state_mib": optimizer_state_bytes(engine.state.optimizer) / 2**20,
            "step_ms": [1e3 * s for s in one["engine_step_s"]],
            "tokens_per_step": one["tokens_per_step"],
            "gpu_name": one.get("gpu_name", "cpu"),
            "final_loss": one["losses"][-1],
        }
        if engine.adapters is not None:
            out["adam_state_bytes_computed_mib"] = adam_state_bytes(
                [p for p in engine.adapters.parameters()]
            ) / 2**20
        if lora is not None and runs > 1:
            rs = RunSet(engine)
            for i in range(1, runs):
                rs.create(f"run{i}", LoraSettings(rank=rank, seed=i))
            ids = list(rs.runs)
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            rounds = []
            for r in range(warmup + steps):
                engine._sync()
                start = time.perf_counter()
                for k, run_id in enumerate(ids):
                    rs.use(run_id)
                    engine.train_step(bench_batch(spec, r * runs + k, dp_rank=0, dp_size=1))
                engine._sync()
                if r >= warmup:
                    rounds.append(time.perf_counter() - start)
            out["runs"] = runs
            out["round_ms"] = [1e3 * s for s in rounds]
            out["runs_peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0
            out["run_steps"] = [r["steps"] for r in rs.describe()]
        return out
    finally:
        engine.shutdown()


def _sampling_case(
    *, spec_wire: dict[str, Any], rank: int, adapters: int, batch: int, prompt: int, tokens: int
) -> Any:
    """Sampling tokens/s of one batch: every row with one adapter, with ``adapters`` different
    ones (one multi-LoRA forward), and with the base alone (the worker's sample_batch)."""
    warnings.filterwarnings("ignore")
    import json as _json

    import torch

    from tgruntime.controller import DataProto
    from tgruntime.trainer.steptime import bench_batch
    from tgruntime.trainer.worker import MegatronTrainer

    wire = {**spec_wire, "lora": {"rank": rank, "alpha": rank}}
    worker = MegatronTrainer(_json.dumps(wire))
    try:
        worker.init_model()
        spec = worker.spec
        names = []
        for i in range(adapters):
            if i:
                worker.create_run(f"run{i}", _json.dumps({"rank": rank, "alpha": rank, "seed": i}))
            worker.train_model(DataProto.from_dict(tensors={"input_ids": bench_batch(spec, i)}))
            worker.save_sampler_weights(f"s{i}")
            names.append(f"s{i}")
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(2, spec.model.vocab_size, (batch, prompt), generator=g).tolist()
        cases: dict[str, list[str | None]] = {
            "one adapter": [names[0]] * batch,
            f"{adapters} adapters": [names[i % adapters] for i in range(batch)],
            "base": [None] * batch,
        }
        out: dict[str, Any] = {"batch": batch, "prompt": prompt, "max_tokens": tokens}
        for label, weights in cases.items():
            times = []
            for rep in range(3):
                worker.engine._sync()  # type: ignore[union-attr]
                start = time.perf_counter()
                res = worker.sample_batch(
                    prompts, weights, max_tokens=tokens, temperature=1.0, seed=rep, stop=[]
                )
                worker.engine._sync()  # type: ignore[union-attr]
                times.append(time.perf_counter() - start)
            made = sum(len(s["tokens"]) for r in res for s in r["sequences"])
            out[label] = {"s": times, "tokens": made, "tokens_per_s": made / min(times[1:])}
        return out
    finally:
        worker.shutdown()


def main() -> int:
    import tgapi
    from bench_step import preset_spec
    from tgruntime.trainer.launch import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="seed")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--sample-batch", type=int, default=16)
    p.add_argument("--sample-tokens", type=int, default=128)
    a = p.parse_args()
    import torch

    spec = preset_spec(a.preset, gpu=torch.cuda.is_available())
    wire = tgapi.to_wire(spec)
    wire["model"]["positionEmbedding"] = "rope"  # GPU's "auto"; on a CPU smoke run too (LoRA)
    rows = []
    for rank in (0, a.rank):
        (row,) = launch(
            _case,
            world_size=1,
            kwargs={
                "spec_wire": wire,
                "rank": rank,
                "runs": a.runs,
                "steps": a.steps,
                "warmup": a.warmup,
            },
            timeout_s=900,
        )
        rows.append(row)
    full, lora = rows
    med = {r["case"]: statistics.median(r["step_ms"]) for r in rows}
    tokens = full["tokens_per_step"]
    print(f"{a.preset} on {full['gpu_name']}, {tokens} tokens/step")
    head = ("case", "step ms", "tokens/s", "peak GiB", "Adam MiB", "trained")
    widths = (9, 10, 9, 9, 12)
    print(f"{head[0]:<10} " + " ".join(f"{h:>{w}}" for h, w in zip(head[1:], widths, strict=True)))
    for r in rows:
        m = med[r["case"]]
        trained = r["adapter_parameters"] or r["parameters"]
        print(
            f"{r['case']:<10} {m:>9.1f} {tokens / m * 1e3:>10.0f} {r['peak_memory_gib']:>9.2f} "
            f"{r['optimizer_state_mib']:>9.1f} {trained:>12,}"
        )
    summary: dict[str, Any] = {
        "preset": a.preset,
        "lora_over_full_step_time": med[lora["case"]] / med["full"],
        "lora_over_full_peak_memory": lora["peak_memory_gib"] / max(full["peak_memory_gib"], 1e-9),
    }
    if "round_ms" in lora:
        round_ms = statistics.median(lora["round_ms"])
        agg = lora["runs"] * tokens / round_ms * 1e3
        single = tokens / med[lora["case"]] * 1e3
        summary.update(
            runs=lora["runs"],
            runs_tokens_per_s=agg,
            one_run_tokens_per_s=single,
            runs_over_one=agg / single,
        )
        print(
            f"{lora['runs']} runs round robin: {round_ms:.1f} ms/round, {agg:.0f} tokens/s "
            f"aggregate = {agg / single:.3f} x one run; peak {lora['runs_peak_memory_gib']:.2f} GiB"
        )
    (sampling,) = launch(
        _sampling_case,
        world_size=1,
        kwargs={
            "spec_wire": wire,
            "rank": a.rank,
            "adapters": a.runs,
            "batch": a.sample_batch,
            "prompt": min(64, spec.model.max_sequence_length - a.sample_tokens),
            "tokens": a.sample_tokens,
        },
        timeout_s=900,
    )
    labels = [k for k, v in sampling.items() if isinstance(v, dict)]
    print(
        f"sampling, batch {a.sample_batch} x {a.sample_tokens} new tokens "
        f"({sampling['prompt']}-token prompts):"
    )
    for k in labels:
        print(f"  {k:<12} {sampling[k]['tokens_per_s']:>10.0f} tokens/s")
    one = sampling["one adapter"]["tokens_per_s"]
    summary["sampling_multi_over_one"] = sampling[f"{a.runs} adapters"]["tokens_per_s"] / one
    summary["sampling_base_over_one"] = sampling["base"]["tokens_per_s"] / one
    rows.append({"case": "sampling", **sampling})
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
