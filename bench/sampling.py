"""Sampling throughput of the group's sampler against transformers' ``generate`` (docs/sampling.md).

One process, no Ray: a ``TrainEngine`` of the preset shape (random weights), its
``Sampler`` (KV cache; CUDA graphs on a GPU, and the same without them), and
``LlamaForCausalLM.generate`` on the ``export_hf`` weights, in the same run, for batch 1
and batch 32, ``--prompt`` prompt tokens and ``--new`` new tokens, sampled (temperature 1,
no top-k/top-p). The decode step time is ``(t(new) - t(1)) / (new - 1)`` and is set against
the memory-bandwidth bound: bytes of weights plus KV read per step over the measured
device-to-device copy bandwidth (bytes read + written / time, as KINDS.md measures it).

    python bench/sampling.py --preset seed --device cuda --json docs/results/sampling_h200.json
    python bench/sampling.py --preset tiny --device cpu --prompt 8 --new 16 --batches 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
import tgapi

# path name -> (environment while its Sampler is built, CUDA graphs). The decode step runs
# the lean layers (compiled on a GPU) unless TG_SAMPLER_LEAN=0 (the model's modules);
# TG_SAMPLER_COMPILE=0 keeps the lean layers eager, TG_SAMPLER_ATTENTION=sdpa replaces the
# Triton decode attention by masked SDPA (docs/sampling.md, "The decode step").
PATHS: dict[str, tuple[dict[str, str], bool]] = {
    "graphs": ({}, True),
    "graphs-modules": ({"TG_SAMPLER_LEAN": "0"}, True),
    "graphs-uncompiled": ({"TG_SAMPLER_COMPILE": "0"}, True),
    "graphs-sdpa": ({"TG_SAMPLER_ATTENTION": "sdpa"}, True),
    "eager": ({}, False),
    "eager-modules": ({"TG_SAMPLER_LEAN": "0"}, False),
}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: str, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def _copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    import torch

    n = 2 * 1024**3  # 2 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = _timed(lambda: b.copy_(a), "cuda", 10)
    return 2 * n / statistics.median(times)


def _hf_row(
    hf: Any,
    ids: Any,
    kwargs: dict[str, Any],
    args: argparse.Namespace,
    device: str,
    batch: int,
    base: int,
) -> dict[str, Any]:
    """transformers' ``generate`` on the same prompts and lengths: one row of the table."""
    import torch

    gpu = device == "cuda"
    with torch.no_grad():
        # full-length warm-up: the first long generate runs far slower than later ones
        hf.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **kwargs)
        t_hf = _timed(
            lambda: hf.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **kwargs),
            device,
            args.reps,
        )
        t_hf1 = _timed(
            lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs),
            device,
            args.reps,
        )
    total, first = statistics.median(t_hf), statistics.median(t_hf1)
    return {
        "seconds": total,
        "all_seconds": t_hf,
        "prefill_seconds": first,
        "decode_step_ms": (total - first) / (args.new - 1) * 1e3,
        "tokens_per_s": batch * args.new / total,
        "peak_extra_bytes": (torch.cuda.max_memory_allocated() - base) if gpu else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch
    import transformers

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.hf_worker import export_hf_checkpoint
    from tgruntime.trainer.sampling import Sampler, SamplingParams

    device = args.device
    gpu = device == "cuda"
    spec = bench_step.preset_spec(args.preset, gpu=gpu)
    if not gpu:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    wire = tgapi.to_wire(spec)
    wire["model"]["positionEmbedding"] = "rope"
    spec = tgapi.parse_spec(wire, local=True)
    engine = TrainEngine.create(spec=spec, device=device)
    m = spec.model
    out: dict[str, Any] = {
        "preset": args.preset,
        "model": tgapi.to_wire(m),
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": engine.settings.dtype_name,
        "prompt_tokens": args.prompt,
        "new_tokens": args.new,
        "reps": args.reps,
        "rows": [],
    }
    params_n = sum(p.numel() for p in engine.state.module.parameters())
    elem = torch.empty((), dtype=engine.settings.dtype).element_size()
    weight_bytes = params_n * elem
    out["parameters"] = params_n
    out["weight_bytes"] = weight_bytes
    bw = _copy_bandwidth() if gpu else None
    out["copy_bandwidth_Bps"] = bw

    with tempfile.TemporaryDirectory() as tmp:
        export_hf_checkpoint(engine, path=tmp)
        hf = transformers.LlamaForCausalLM.from_pretrained(
            tmp, torch_dtype=engine.settings.dtype, attn_implementation="sdpa"
        ).to(device)
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    samplers: dict[str, Any] = {}
    paths = ["eager", *[p for p in args.paths if p != "eager"]]
    for name in paths:  # "eager" first: the transformers check below uses it
        env, graphs = PATHS[name]
        if graphs and not gpu:
            continue
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            samplers[name] = Sampler(engine.state.module, cuda_graphs=graphs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    out["paths"] = {
        name: {
            "decode": (
                "modules"
                if s.decoder.lean is None
                else "lean, compiled"
                if s.decoder.lean.compiled
                else "lean"
            ),
            "cuda_graphs": bool(s.cuda_graphs),
        }
        for name, s in samplers.items()
    }
    gen = torch.Generator().manual_seed(0)
    kv_heads = m.num_query_groups or m.num_attention_heads
    head_dim = m.hidden_size // m.num_attention_heads
    kv_per_token = 2 * m.num_layers * kv_heads * head_dim * elem

    # correctness on the device: our sampled log-probs against transformers' forward
    prompt0 = torch.randint(0, m.vocab_size, (args.prompt,), generator=gen).tolist()
    short = SamplingParams.build(max_tokens=min(32, args.new), seed=1, vocab_size=m.vocab_size)
    check = samplers["eager"].generate([prompt0], short)[0]["sequences"][0]
    seq = torch.tensor([prompt0 + check["tokens"]], device=device)
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=seq).logits.float()[0, :-1], -1)
    ref_lp = ref.gather(-1, seq[0, 1:, None])[:, 0][args.prompt - 1 :].cpu()
    out["logprob_max_abs_diff_vs_transformers"] = float(
        (torch.tensor(check["logprobs"]) - ref_lp).abs().max()
    )

    for batch in args.batches:
        prompts = torch.randint(0, m.vocab_size, (batch, args.prompt), generator=gen).tolist()
        full = SamplingParams.build(max_tokens=args.new, seed=7, vocab_size=m.vocab_size)
        one = SamplingParams.build(max_tokens=1, seed=7, vocab_size=m.vocab_size)
        row: dict[str, Any] = {"batch": batch}
        for name, sampler in samplers.items():
            if gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if gpu else 0
            try:
                sampler.generate(prompts, full)  # warm-up (captures the graph)
                t_full = _timed(lambda s=sampler: s.generate(prompts, full), device, args.reps)  # noqa: B023
                t_one = _timed(lambda s=sampler: s.generate(prompts, one), device, args.reps)  # noqa: B023
            except Exception as exc:  # report, keep the other paths' figures
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
                sampler.clear()
                continue
            total, first = statistics.median(t_full), statistics.median(t_one)
            step = (total - first) / (args.new - 1)
            row[name] = {
                "seconds": total,
                "all_seconds": t_full,
                "prefill_seconds": first,
                "decode_step_ms": step * 1e3,
                "tokens_per_s": batch * args.new / total,
                "peak_extra_bytes": (torch.cuda.max_memory_allocated() - base) if gpu else None,
            }
            sampler.clear()
        # transformers' generate, the same prompts and lengths
        if args.no_transformers:
            _bound(row, args, batch, kv_per_token, weight_bytes, bw)
            out["rows"].append(row)
            continue
        ids = torch.tensor(prompts, device=device)
        kwargs = {
            "do_sample": True,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
            "attention_mask": torch.ones_like(ids),
        }
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if gpu else 0
        try:
            row["transformers"] = _hf_row(hf, ids, kwargs, args, device, batch, base)
        except Exception as exc:  # e.g. OOM at batch 128 on an 80 GB card: keep our rows
            row["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
            if gpu:
                torch.cuda.empty_cache()
        _bound(row, args, batch, kv_per_token, weight_bytes, bw)
        out["rows"].append(row)
    engine.shutdown()
    return out


def _bound(
    row: dict[str, Any],
    args: argparse.Namespace,
    batch: int,
    kv_per_token: int,
    weight_bytes: int,
    bw: float | None,
) -> None:
    """The bandwidth bound: weights once + the KV of the average context, per step."""
    avg_ctx = args.prompt + args.new / 2
    kv_bytes = batch * avg_ctx * kv_per_token
    row["kv_cache_bytes"] = batch * (args.prompt + args.new) * kv_per_token
    row["bytes_per_step"] = weight_bytes + kv_bytes
    if bw:
        row["bound_step_ms"] = (weight_bytes + kv_bytes) / bw * 1e3  # as issue 25 counts


def _table(res: dict[str, Any]) -> str:
    lines = [
        f"{res['preset']} on {res['device']} ({res['dtype']}), prompt {res['prompt_tokens']}, "
        f"new {res['new_tokens']}; params {res['parameters']:,}; "
        f"logprob |diff| vs transformers {res['logprob_max_abs_diff_vs_transformers']:.2e}",
        "| batch | path | tokens/s | decode step ms | prefill s | x generate | bound ms | "
        "of bound | peak extra GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in res["rows"]:
        hf = row.get("transformers", {"error": "skipped"})
        for name in (*PATHS, "transformers"):
            r = row.get(name)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {row['batch']} | {name} | error: {r['error'][:80]} |")
                continue
            bound = row.get("bound_step_ms")
            peak = r["peak_extra_bytes"]
            step = r["decode_step_ms"]
            bound_s = "" if bound is None else f"{bound:.2f}"
            share = "" if bound is None else f"{bound / step:.2f}"
            peak_s = "" if peak is None else f"{peak / 2**30:.2f}"
            ratio_s = "" if "error" in hf else f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}"
            decode = res.get("paths", {}).get(name, {}).get("decode", "")
            lines.append(
                f"| {row['batch']} | {name} ({decode}) | {r['tokens_per_s']:,.0f} | {step:.2f} | "
                f"{r['prefill_seconds']:.3f} | {ratio_s} | {bound_s} | {share} | {peak_s} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="seed", choices=sorted(bench_step.PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument(
        "--paths",
        nargs="+",
        default=["graphs", "eager"],
        choices=sorted(PATHS),
        help="sampler paths to time (graph paths only on a GPU)",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip generate's rows")
    args = p.parse_args()
    res = run(args)
    print(_table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
