"""The Tinker server's cost: SDK forward_backward + optim_step against the same TrainerClient
calls on the same group, in the same run (alternating rounds).

    OMP_NUM_THREADS=1 .venv/bin/python bench/tinker_overhead.py --steps 10 --rounds 3

Prints a table; writes docs/results/tinker_overhead_<device>.json. On CPU the difference of the
medians is the server's fixed overhead per (forward_backward + optim_step) pair, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TINKER_TELEMETRY", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_group import served_group, spec

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "seed", "llama8b-block"])
    ap.add_argument("--layers", type=int, default=0,
                    help="override the preset's layer count (0: the preset's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import tinker

    T = tinker.types
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinker-bench-{uuid.uuid4().hex[:6]}"
    sp = spec(args.tp, str(tmp), args.preset, layers=args.layers)
    g = np.random.default_rng(0)
    vocab = sp.model.vocab_size
    toks = g.integers(0, vocab, size=(args.batch, args.seq + 1))
    data = [
        T.Datum(
            model_input=T.ModelInput.from_ints([int(t) for t in row[:-1]]),
            loss_fn_inputs={
                "target_tokens": T.TensorData.from_numpy(row[1:].astype(np.int64)),
                "weights": T.TensorData.from_numpy(np.ones(args.seq, np.float32)),
            },
        )
        for row in toks
    ]
    batch = {
        "input_ids": torch.from_numpy(toks[:, :-1].copy()),
        "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.int64),
        "target_ids": torch.from_numpy(toks[:, 1:].copy()),
        "loss_mask": torch.ones(args.batch, args.seq),
    }
    adam = T.AdamParams(learning_rate=1e-4)
    times: dict[str, list[float]] = {"TrainerClient": [], "tinker SDK": []}
    with served_group("bench", sp) as served:
        use_gpu, client = served.use_gpu, served.client
        with tinker.ServiceClient(base_url=served.running.url, api_key=served.key) as sc:
            tc = sc.create_lora_training_client(base_model="bench", rank=8).result()

            def direct() -> None:
                client.forward_backward(batch, loss="tinker_cross_entropy", reduction="sum")
                client.optim_step(
                    lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, grad_clip=0.0
                ).result(timeout=600)

            def sdk() -> None:
                tc.forward_backward(data, "cross_entropy")
                tc.optim_step(adam).result(timeout=600)

            for fn in (direct, sdk):  # warm-up
                fn()
            for _ in range(args.rounds):
                for name, fn in (("TrainerClient", direct), ("tinker SDK", sdk)):
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    p10 = {k: float(np.percentile(v, 10)) for k, v in times.items()}
    p90 = {k: float(np.percentile(v, 90)) for k, v in times.items()}
    tokens = args.batch * args.seq
    print(f"{'path':<15} {'median ms':>10} {'p10-p90 ms':>16} {'tokens/s':>10}")
    for k in times:
        rate = tokens / med[k] * 1e3
        print(f"{k:<15} {med[k]:>10.1f} {p10[k]:>7.1f}-{p90[k]:<8.1f} {rate:>10.0f}")
    ratio = med["TrainerClient"] / med["tinker SDK"]
    overhead = med["tinker SDK"] - med["TrainerClient"]
    print(
        f"throughput ratio SDK/TrainerClient {ratio:.3f}; fixed overhead {overhead:.1f} ms "
        "per forward_backward + optim_step"
    )
    device = "cuda" if use_gpu else "cpu"
    out = {
        "device": device,
        "preset": args.preset,
        "tp": args.tp,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "rounds": args.rounds,
        "median_ms": med,
        "p10_ms": p10,
        "p90_ms": p90,
        "ratio": ratio,
        "overhead_ms_per_pair": overhead,
        "samples_ms": times,
        "date": time.strftime("%Y-%m-%d"),
    }
    path = Path(args.json or ROOT / "docs" / "results" / f"tinker_overhead_{device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
