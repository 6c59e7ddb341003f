"""A cookbook-shaped RL loop through the unmodified Tinker SDK, watching the group's memory.

Each iteration does what the cookbook's RL recipes do: ``save_weights_and_get_sampling_client``;
``sample(num_samples=G)`` for P prompts of 32-256 tokens, all in flight together; one
``forward_backward(..., "importance_sampling")`` over every sequence (P x G of them); one
``optim_step``. Per iteration it records the GPU memory in use (device-wide, nvidia-smi or
torch), the in-memory sampler weights the group holds (``sampler_weights_info``) and the
phase times. At the end, one ``forward_backward`` of ``--big-rows`` rows of ``--big-len``
tokens (the issue's 256-sequence case at full length) checks the token budget's split.

    python bench/rl_memory.py --preset seed --iters 45 --json $OUT/rl_memory.json   # H200
    python bench/rl_memory.py --preset tiny --iters 5 --prompts 4 --group 2 --max-tokens 8 \
        --big-rows 16 --big-len 48                                                  # CPU
    python bench/rl_memory.py --preset seed --lora 32 ...   # a LoRA group (spec.lora), rank-32 runs

``--compare-client`` also sends, in every iteration, the same rows to the group's own
``TrainerClient.sample`` and the same ``forward_backward`` straight to the group (then
``zero_grad``); those comparisons are timed apart and are not in the loop's phase times
(before 2026-12-06 11:10 they were counted in ``fb_s``).

Prints a table (every 5th iteration and the last); ``--json`` saves every row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TINKER_TELEMETRY", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_group import served_group, spec


def gpu_used_gib() -> float | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
        return round(sum(float(x) for x in out.split()) / 1024, 2)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _direct_fb(client: Any, data: list[Any], vocab: int, limit: int) -> dict[str, Any]:
    """The iteration's ``forward_backward`` sent to the group as ``TrainerClient`` sends it (the
    tensors the server would build), timed, then ``zero_grad``: the SDK's call that follows
    accumulates from zero. ``client_fb_s``: the group call alone; ``client_fb_worker_s``: the
    trainer's own time inside it (its ``elapsed_s``)."""
    from tgruntime.service.codec import DatumIn
    from tgruntime.service.datum import to_tensors
    from tgruntime.trainer.tinker_losses import tinker_loss_name

    ins = [DatumIn(tokens=np.asarray(d.model_input.to_ints(), np.int64),
                   inputs={k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}) for d in data]
    batch, _ = to_tensors(ins, loss="importance_sampling", vocab_size=vocab, max_len=limit, dp=1)
    t0 = time.perf_counter()
    out = client.forward_backward(batch, loss=tinker_loss_name("importance_sampling"),
                                  reduction="sum").result(timeout=1200)
    fb_s = time.perf_counter() - t0
    client.zero_grad().result(timeout=600)
    meta = out.meta_info
    return {"client_fb_s": round(fb_s, 3),
            "client_fb_worker_s": round(float(meta.get("elapsed_s", 0.0)), 3),
            **{f"client_fb_{k}": meta.get(k) for k in ("micro_batches", "cuda_mallocs",
                                                       "alloc_retries")}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "seed", "llama8b-block"])
    ap.add_argument("--layers", type=int, default=0,
                    help="override the preset's layer count (0: the preset's)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=45)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--big-rows", type=int, default=256)
    ap.add_argument("--big-len", type=int, default=512)
    ap.add_argument("--big-min-len", type=int, default=0,
                    help="the big call's rows get random lengths in [this, --big-len] "
                         "(0: all --big-len)")
    ap.add_argument("--big-vs-train", action="store_true",
                    help="after the big call, train_step (train_model's path) on the same "
                         "tokens as dense rows of --big-len, through the group's TrainerClient")
    ap.add_argument("--kind", default="snapshot", choices=["snapshot", "inflight"],
                    help="save_weights_and_get_sampling_client's kind (inflight: no copy)")
    ap.add_argument("--lora", type=int, default=0,
                    help="a LoRA group (spec.lora, alpha = rank), runs of this rank; 0: full")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="stop iterating after this many seconds (0: none), then the big call")
    ap.add_argument("--print-every", type=int, default=5)
    ap.add_argument("--compare-client", action="store_true",
                    help="each iteration, sample the same rows once more through the group's "
                         "own TrainerClient.sample (one call, every prompt): the SDK's "
                         "sampling tokens/s against the engine's, in the same run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import tinker

    T = tinker.types
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"rl-memory-{uuid.uuid4().hex[:6]}"
    sp = spec(args.tp, str(tmp), args.preset, layers=args.layers)
    if args.lora:
        import tgapi

        wire = tgapi.to_wire(sp)
        wire["lora"] = {"rank": args.lora, "alpha": args.lora}
        sp = tgapi.parse_spec(wire, local=True)
    vocab, limit = sp.model.vocab_size, sp.model.max_sequence_length
    g = np.random.default_rng(0)
    lo, hi = min(32, limit // 4), min(256, limit // 2)
    params = T.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    adam = T.AdamParams(learning_rate=1e-5)
    rows: list[dict[str, Any]] = []
    with served_group("rlmem", sp) as served:
        use_gpu, client = served.use_gpu, served.client
        print(f"{'iter':>4} {'GPU GiB':>8} {'copies':>6} {'copy GiB':>8} {'save s':>7} "
              f"{'sample s':>8} {'tok/s':>8} {'fb s':>6} {'fb tokens':>9} {'step s':>6}")
        with tinker.ServiceClient(base_url=served.running.url, api_key=served.key) as sc:
            tc = sc.create_lora_training_client(base_model="rlmem",
                                                rank=args.lora or 8).result()
            start = time.perf_counter()
            for it in range(args.iters):
                if args.time_limit and time.perf_counter() - start > args.time_limit:
                    print(f"--time-limit {args.time_limit:g} s reached after {it} iterations",
                          flush=True)
                    break
                t0 = time.perf_counter()
                sampler = tc.save_weights_and_get_sampling_client(kind=args.kind).result()
                samples = served.running.service.samples
                calls0, call_s0, worker_s0 = samples.calls, samples.call_s, samples.worker_s
                engine0 = samples.engine
                t1 = time.perf_counter()
                prompts = [
                    [int(x) for x in g.integers(2, vocab, size=int(g.integers(lo, hi + 1)))]
                    for _ in range(args.prompts)
                ]
                futures = [
                    sampler.sample(T.ModelInput.from_ints(p), num_samples=args.group,
                                   sampling_params=params)
                    for p in prompts
                ]
                results = [f.result(timeout=1200) for f in futures]
                t_sampled = time.perf_counter()
                group_calls = samples.calls - calls0
                group_s = samples.call_s - call_s0
                # inside the workers' calls, and the engine's own split (SlotEngine.info)
                split = {"sample_worker_s": round(samples.worker_s - worker_s0, 3)}
                engine1 = samples.engine
                for key in ("run_s", "prefill_s", "prefill_device_s", "decode_device_s",
                            "host_s", "steps",
                            "prefills", "prefill_tokens", "calls", "adapter_s"):
                    if key in engine1:
                        split[f"sample_engine_{key}"] = round(
                            engine1[key] - engine0.get(key, 0), 4)
                for key in ("decode_path", "graphs", "adapter_rebuilds", "adapter_refills"):
                    if key in engine1:  # as of the iteration's end (not differences)
                        split[f"sample_engine_{key}"] = engine1[key]
                data, sampled = [], 0
                for p, res in zip(prompts, results, strict=True):
                    for seq in res.sequences:
                        toks = p + list(seq.tokens)
                        sampled += len(seq.tokens)
                        n = len(toks) - 1
                        w = np.zeros(n, np.float32)
                        w[len(p) - 1:] = 1.0
                        old = np.zeros(n, np.float32)
                        old[len(p) - 1:] = np.asarray(seq.logprobs, np.float32)
                        data.append(T.Datum(
                            model_input=T.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={
                                "target_tokens": T.TensorData.from_numpy(
                                    np.asarray(toks[1:], np.int64)),
                                "weights": T.TensorData.from_numpy(w),
                                "logprobs": T.TensorData.from_numpy(old),
                                "advantages": T.TensorData.from_numpy(
                                    (w * float(g.normal())).astype(np.float32)),
                            },
                        ))
                direct: dict[str, Any] = {}
                if args.compare_client:
                    c0 = time.perf_counter()
                    got = client.sample(prompts, max_tokens=args.max_tokens, temperature=1.0,
                                        num_samples=args.group, stop=[]).result(timeout=1200)
                    c_s = time.perf_counter() - c0
                    c_tok = sum(len(q["tokens"]) for r in got for q in r["sequences"])
                    # the one-shot call's own device split (Sampler.last), beside the engine's
                    shot = client.sampler_weights_info().result(timeout=600).get("one_shot", {})
                    direct = {**{f"client_{k}": v for k, v in shot.items()},
                              "client_sample_s": round(c_s, 3),
                              "client_tok_s": round(c_tok / max(c_s, 1e-9)),
                              "sdk_over_client": round((sampled / max(t_sampled - t1, 1e-9))
                                                       / max(c_tok / max(c_s, 1e-9), 1e-9), 3)}
                if args.compare_client:  # the same call straight to the group, then dropped
                    direct.update(_direct_fb(client, data, vocab, limit))
                t2 = time.perf_counter()  # the direct comparisons above are not the loop's
                fb = tc.forward_backward(data, "importance_sampling").result(timeout=1200)
                t3 = time.perf_counter()
                tc.optim_step(adam).result(timeout=1200)
                t4 = time.perf_counter()
                info = client.sampler_weights_info().result(timeout=600)
                row = {
                    "iter": it + 1,
                    "gpu_used_gib": gpu_used_gib() if use_gpu else None,
                    "copies": len(info["names"]),
                    "copy_gib": round(info["bytes"] / 2**30, 3),
                    "copy_bytes": info["bytes"],
                    # one-shot snapshot sampling's one-slot stacks built so far (cumulative)
                    "uniform_builds": info.get("uniform_builds"),
                    # spec.training.samplerWeightsMemory as resolved (the default: from free memory)
                    "budget_bytes": info.get("budget_bytes"),
                    "budget_source": info.get("budget_source"),
                    "save_s": round(t1 - t0, 3),
                    "sample_s": round(t_sampled - t1, 3),
                    "sample_tok_s": round(sampled / max(t_sampled - t1, 1e-9)),
                    "sample_group_calls": group_calls,  # sample/sample_batch or step chunks
                    # inside sample_step chunks; sample_s minus this: the SDK's and the
                    # service's own time (requests, gather, futures)
                    "sample_group_s": round(group_s, 3),
                    **split,
                    "fb_s": round(t3 - t2, 3),
                    **({"sdk_fb_over_client": round(direct["client_fb_s"] / max(t3 - t2, 1e-9), 3)}
                       if "client_fb_s" in direct else {}),
                    "fb_tokens": sum(len(d.model_input.to_ints()) for d in data),
                    "step_s": round(t4 - t3, 3),
                    "loss": fb.metrics.get("loss:sum"),
                    **direct,
                }
                rows.append(row)
                if (it + 1) % args.print_every == 0 or it + 1 == args.iters or it == 0:
                    print(f"{row['iter']:>4} {row['gpu_used_gib']!s:>8} {row['copies']:>6} "
                          f"{row['copy_gib']:>8} {row['save_s']:>7} {row['sample_s']:>8} "
                          f"{row['sample_tok_s']:>8} {row['fb_s']:>6} {row['fb_tokens']:>9} "
                          f"{row['step_s']:>6}"
                          + f" calls {group_calls} ({group_s:.3f} s)"
                          + "".join(f" {k.removeprefix('sample_')} {v}" for k, v in split.items())
                          + (f" client {row['client_sample_s']} s" if direct else "")
                          + "".join(f" client_{k} {row[f'client_{k}']}"
                                    for k in ("prefill_device_s", "decode_device_s")
                                    if f"client_{k}" in row)
                          + (f" sdk/client {row['sdk_over_client']}" if direct else ""),
                          flush=True)
            # the 256 x ~400-token case, at --big-len tokens per row
            length = min(args.big_len, limit)
            lens = ([int(x) for x in g.integers(min(args.big_min_len, length), length + 1,
                                                 size=args.big_rows)]
                    if args.big_min_len else [length] * args.big_rows)
            big = [
                T.Datum(
                    model_input=T.ModelInput.from_ints(
                        [int(x) for x in g.integers(2, vocab, size=n)]),
                    loss_fn_inputs={
                        "target_tokens": T.TensorData.from_numpy(
                            g.integers(2, vocab, size=n).astype(np.int64)),
                        "weights": T.TensorData.from_numpy(np.ones(n, np.float32)),
                    },
                )
                for n in lens
            ]
            big_tokens = sum(lens)
            t0 = time.perf_counter()
            big_fb = tc.forward_backward(big, "cross_entropy").result(timeout=1200)
            big_s = time.perf_counter() - t0
            tc.optim_step(adam).result(timeout=1200)
            big_step_s = time.perf_counter() - t0
            big_gib = gpu_used_gib() if use_gpu else None
            dense: dict[str, Any] | None = None
            if args.big_vs_train:  # the same number of tokens, as dense rows, train_model's path
                import torch

                rows_n = max(1, big_tokens // length)
                ids = torch.as_tensor(g.integers(2, vocab, size=(rows_n, length)),
                                      dtype=torch.int64)
                client.train_step({"input_ids": ids}).result(timeout=1200)  # warm-up
                t0 = time.perf_counter()
                client.train_step({"input_ids": ids}).result(timeout=1200)
                d_s = time.perf_counter() - t0
                dense = {"rows": rows_n, "tokens": rows_n * length, "seconds": round(d_s, 2),
                         "tokens_per_s": round(rows_n * length / d_s),
                         "sdk_fb_step_over_train_model": round(
                             (big_tokens / big_step_s) / (rows_n * length / d_s), 3)}
        used = [r["gpu_used_gib"] for r in rows if r["gpu_used_gib"] is not None]
        at5 = [r for r in rows if r["iter"] == 5]
        summary = {
            "preset": args.preset,
            "weights": f"LoRA rank {args.lora}" if args.lora else "full",
            "iters": len(rows),
            "args": vars(args),
            "save_and_sample_calls": {"save_weights_and_get_sampling_client": len(rows),
                                      "sample": len(rows) * args.prompts},
            "gpu_used_gib_first_last_max": [used[0], used[-1], max(used)] if used else None,
            "gpu_used_gib_at_5": at5[0]["gpu_used_gib"] if at5 else None,
            "copies_at_5_last_max": [at5[0]["copies"] if at5 else None, rows[-1]["copies"],
                                     max(r["copies"] for r in rows)],
            "copy_gib_at_5_last_max": [at5[0]["copy_gib"] if at5 else None, rows[-1]["copy_gib"],
                                       max(r["copy_gib"] for r in rows)],
            "loop_s": round(sum(r["save_s"] + r["sample_s"] + r["fb_s"] + r["step_s"]
                                for r in rows), 1),
            "max_copies": max(r["copies"] for r in rows),
            "median_s": {k: float(np.median([r[k] for r in rows[1:] or rows]))
                         for k in ("save_s", "sample_s", "sample_group_s", "fb_s", "step_s")},
            "first_over_median_iteration": round(
                (rows[0]["save_s"] + rows[0]["sample_s"] + rows[0]["fb_s"] + rows[0]["step_s"])
                / max(float(np.median([r["save_s"] + r["sample_s"] + r["fb_s"] + r["step_s"]
                                       for r in rows[1:] or rows])), 1e-9), 2),
            "median_sample_tok_s": float(np.median([r["sample_tok_s"] for r in rows[1:] or rows])),
            "median_sdk_over_client": (
                float(np.median([r["sdk_over_client"] for r in rows[1:] or rows]))
                if args.compare_client else None),
            "big_forward_backward": {"rows": args.big_rows,
                                     "tokens_per_row": [min(lens), max(lens)],
                                     "tokens": big_tokens, "seconds": round(big_s, 2),
                                     "tokens_per_s": round(big_tokens / big_s),
                                     "with_optim_step_s": round(big_step_s, 2),
                                     "train_model_same_tokens": dense,
                                     "loss_sum": big_fb.metrics.get("loss:sum"),
                                     "gpu_used_gib_after": big_gib},
            "rows": rows,
        }
        print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
