"""Soft targets (``cross_entropy`` with K target ids a position, Tinker's top-K distillation):
one forward pass of a ``[B, S, K]`` batch against the same targets as K rows of ``[B, S]``
(the form the service sent until 2026-12-06), on one ``TrainEngine`` in one process.

    python bench/soft_targets.py                       # CPU, a small Llama, K = 1, 4, 16
    python bench/soft_targets.py --device cuda --vocab 32000 --hidden 2048 --layers 16 \\
        --rows 16 --seq 1024 --k 1 8 20 --json docs/results/soft_targets_gpu.json

Prints a table (median seconds of ``forward_backward`` per form, and their ratio) and saves
the rows as JSON. Both forms give the same loss and gradient
(tests/trainer/test_token_budget.py::test_soft_targets_in_one_pass_equal_k_rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import tgapi
from tgruntime.trainer.launch import launch


def _spec(a: argparse.Namespace) -> tgapi.TrainerGroupSpec:
    return tgapi.parse_spec({
        "workers": {"useGpu": a.device == "cuda", "processesPerNode": [1]},
        "model": {
            "vocabSize": a.vocab, "hiddenSize": a.hidden, "numLayers": a.layers,
            "numAttentionHeads": a.heads, "ffnHiddenSize": 4 * a.hidden,
            "maxSequenceLength": a.seq,
        },
        "training": {"batchSize": a.rows, "sequenceLength": a.seq},
    }, local=True)


def _rank(spec: tgapi.TrainerGroupSpec, ks: list[int], rows: int, seq: int, vocab: int,
          repeats: int) -> list[dict[str, Any]]:
    import torch

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.token_batch import token_batch

    engine = TrainEngine.create(spec=spec)
    g = torch.Generator().manual_seed(0)
    out = []
    try:
        for k in ks:
            ids = torch.randint(0, vocab, (rows, seq), generator=g)
            mask = torch.ones((rows, seq), dtype=torch.int64)
            target = torch.randint(0, vocab, (rows, seq, k), generator=g)
            weights = torch.rand((rows, seq, k), generator=g)
            soft = {"input_ids": ids, "attention_mask": mask, "target_ids": target,
                    "target_weights": weights}
            as_rows = {"input_ids": ids.repeat(k, 1), "attention_mask": mask.repeat(k, 1),
                       "target_ids": torch.cat([target[..., c] for c in range(k)]),
                       "loss_mask": torch.cat([weights[..., c] for c in range(k)])}
            row: dict[str, Any] = {"k": k, "rows": rows, "seq": seq}
            for name, tensors in (("one_pass", soft), ("k_rows", as_rows)):
                batch = token_batch(tensors, device=engine.device, vocab_size=vocab)
                times, losses = [], []
                for _ in range(repeats + 1):  # the first is a warm-up
                    engine.zero_grad()
                    engine._sync()
                    t0 = time.perf_counter()
                    r = engine.forward_backward(batch, loss="tinker_cross_entropy",
                                                reduction="sum")
                    engine._sync()
                    times.append(time.perf_counter() - t0)
                    losses.append(r.loss)
                row[f"{name}_s"] = statistics.median(times[1:])
                row[f"{name}_loss"] = losses[-1]
            row["speedup"] = row["k_rows_s"] / row["one_pass_s"]
            out.append(row)
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--k", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="docs/results/soft_targets_cpu.json")
    a = p.parse_args(argv)
    (rows,) = launch(_rank, world_size=1, timeout_s=3600, kwargs={
        "spec": _spec(a), "ks": a.k, "rows": a.rows, "seq": a.seq, "vocab": a.vocab,
        "repeats": a.repeats,
    })
    print(f"{'K':>4} {'one pass s':>11} {'K rows s':>9} {'K rows / one pass':>18} "
          f"{'loss diff (rel)':>16}")
    for r in rows:
        rel = abs(r["one_pass_loss"] - r["k_rows_loss"]) / max(1.0, abs(r["k_rows_loss"]))
        print(f"{r['k']:>4} {r['one_pass_s']:>11.3f} {r['k_rows_s']:>9.3f} "
              f"{r['speedup']:>18.2f} {rel:>16.1e}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1) + "\n")
    print(f"saved {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
