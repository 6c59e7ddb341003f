"""``forward_backward`` + ``optim_step`` throughput against ``train_model``, one machine.

A private local Ray session starts one MegatronTrainer group (the preset's shape, all of
its ranks on this machine) and a ``TrainerClient`` drives it with the same deterministic
batches (``steptime.bench_batch``), in alternating rounds so drift hits both paths alike:

- ``train_model``: one blocking call per step (the existing path);
- ``fb+step``: ``forward_backward(cross_entropy)`` and ``optim_step`` submitted back to back
  (two calls, one wait per step), the way an RL loop uses the primitives;
- ``fb+step serial``: the same, waiting for each call (the worst case);
- ``export_hf`` once, when the workers have it.

Ratio = train_model median / fb+step median (1.0 = the primitives cost nothing; issue 13's
target >= 0.98). It also checks, on the real device, that two accumulated calls give the
same gradient norm as one call on the concatenated batch. Prints a table; ``--json`` saves.

    python bench/gpu/rl_throughput.py --preset seed --json $OUT/rl_throughput.json   # H200
    python bench/gpu/rl_throughput.py --preset tiny --cpu --steps 3 --warmup 1         # CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_step
import tgapi
from tgruntime.trainer.steptime import bench_batch, flops_per_step, summarize


def _timed(fn: Any, *, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch

    from tgruntime import TrainerClient
    from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from tgruntime.trainer.worker import MegatronTrainer

    gpu = not args.cpu
    base = bench_step.preset_spec(args.preset, gpu=gpu, tp=args.tp)
    wire = tgapi.to_wire(base)
    wire["model"]["positionEmbedding"] = "rope"  # GPU "auto" is RoPE; an HF Llama needs it
    spec = tgapi.parse_spec(wire, local=True)
    world = spec.world_size
    ray.init(
        address="local",
        num_cpus=max(2, world + 1),
        num_gpus=world if gpu else 0,
        include_dashboard=False,
        namespace=f"tg-rl-bench-{uuid.uuid4().hex[:6]}",
        log_to_driver=False,
    )
    wg = WorkerGroup.create(
        group_name=f"rl-bench-{uuid.uuid4().hex[:6]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[world], use_gpu=gpu, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(spec))),
        detached=False,
        pg_timeout_s=300,
        actor_timeout_s=600,
    )
    try:
        mesh = wg.init_model()[0]
        client = TrainerClient(wg)
        wait = args.call_timeout
        counter = iter(range(10**9))

        def batch() -> dict[str, torch.Tensor]:
            return {"input_ids": bench_batch(spec, next(counter) % 8)}

        def train_model() -> None:
            client.train_step(batch()).result(timeout=wait)

        def fb_step() -> None:
            client.forward_backward(batch())  # not waited: the step call queues behind it
            client.optim_step().result(timeout=wait)

        def fb_step_serial() -> None:
            client.forward_backward(batch()).result(timeout=wait)
            client.optim_step().result(timeout=wait)

        paths = {"train_model": train_model, "fb+step": fb_step, "fb+step serial": fb_step_serial}
        times: dict[str, list[float]] = {k: [] for k in paths}
        for fn in paths.values():
            _timed(fn, steps=args.warmup)
        per_round = max(1, args.steps // args.rounds)
        for _ in range(args.rounds):
            for name, fn in paths.items():
                times[name] += _timed(fn, steps=per_round)

        # accumulation on the device: 2 halves then a step == the whole batch then a step,
        # compared through the gradient norm (lr 0: the weights stay as they are)
        whole = bench_batch(spec, 99)
        half = whole.shape[0] // 2
        client.forward_backward({"input_ids": whole[:half]})
        client.forward_backward({"input_ids": whole[half:]})
        acc = client.optim_step(lr=0.0).result(timeout=wait)["grad_norm"]
        client.forward_backward({"input_ids": whole})
        one = client.optim_step(lr=0.0).result(timeout=wait)["grad_norm"]

        export: dict[str, Any] | None = None
        if "export_hf" in wg.method_names and not args.no_export:
            with tempfile.TemporaryDirectory(dir=args.export_dir) as tmp:
                t0 = time.perf_counter()
                try:
                    client.export_hf(str(Path(tmp) / "hf")).result(timeout=wait)
                    seconds = time.perf_counter() - t0
                    size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
                    export = {"export_hf_s": seconds, "bytes": size}
                except Exception as exc:  # keep the throughput figures; report the failure
                    export = {"error": str(exc).splitlines()[0]}
    finally:
        wg.teardown()
        ray.shutdown()

    tokens = spec.training.batch_size * spec.training.sequence_length
    flops = flops_per_step(spec)
    rows: dict[str, dict[str, Any]] = {}
    for name, values in times.items():
        stats = summarize(values)
        rows[name] = {
            "step_s": stats,
            "tokens_per_s": tokens / stats["median"],
            "tflops": flops / stats["median"] / 1e12,
        }
    base = rows["train_model"]["step_s"]["median"]
    return {
        "preset": args.preset,
        "model": tgapi.to_wire(spec.model),
        "batch": [spec.training.batch_size, spec.training.sequence_length],
        "tp": args.tp,
        "device": mesh.get("device"),
        "dtype": mesh.get("dtype"),
        "steps_per_path": len(times["train_model"]),
        "rows": rows,
        "ratio": base / rows["fb+step"]["step_s"]["median"],
        "ratio_serial": base / rows["fb+step serial"]["step_s"]["median"],
        "accumulation": {
            "grad_norm_2_calls": acc,
            "grad_norm_1_call": one,
            "rel_diff": abs(acc - one) / max(abs(one), 1e-12),
        },
        "export_hf": export,
        "torch": torch.__version__,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"preset {result['preset']} tp={result['tp']} batch {result['batch']} on "
        f"{result['device']} ({result['dtype']}), {result['steps_per_path']} steps per path",
        f"{'path':<16} {'median ms':>10} {'p10-p90 ms':>16} {'tokens/s':>12} {'TFLOP/s':>9}",
    ]
    for name, row in result["rows"].items():
        s = row["step_s"]
        lines.append(
            f"{name:<16} {s['median'] * 1e3:>10.1f} "
            f"{s['p10'] * 1e3:>7.1f}-{s['p90'] * 1e3:<8.1f} "
            f"{row['tokens_per_s']:>12,.0f} {row['tflops']:>9.1f}"
        )
    lines.append(
        f"ratio train_model / fb+step: {result['ratio']:.3f} "
        f"(serial: {result['ratio_serial']:.3f}; target >= 0.98)"
    )
    acc = result["accumulation"]
    lines.append(
        f"accumulation: grad norm 2 calls {acc['grad_norm_2_calls']:.6f} vs 1 call "
        f"{acc['grad_norm_1_call']:.6f} (rel diff {acc['rel_diff']:.2e})"
    )
    e = result["export_hf"]
    if e and "error" in e:
        lines.append(f"export_hf: failed: {e['error']}")
    elif e:
        lines.append(f"export_hf: {e['export_hf_s']:.2f} s, {e['bytes'] / 2**30:.2f} GiB")
    else:
        lines.append("export_hf: not measured (the workers have no export_hf, or --no-export)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--preset", default="seed", choices=sorted(bench_step.PRESETS))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="CPU workers (gloo, fp32): a smoke run")
    p.add_argument("--steps", type=int, default=20, help="timed steps per path")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4, help="alternations of the paths")
    p.add_argument("--call-timeout", type=float, default=600.0)
    p.add_argument("--no-export", action="store_true")
    p.add_argument("--export-dir", default=None, help="where export_hf writes (a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = run(args)
    print(table(result), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
