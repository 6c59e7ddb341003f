"""The draw of a decode step (``sampling/draw.py``), eager against compiled, on one GPU.

Prints a table (milliseconds per draw, the eager draw's memory traffic estimate) and saves
JSON with ``--json``; run through ``bench/gpu/run_on_device.sh`` or any CUDA machine:

    python bench/sampling_draw.py --json $OUT/sampling_draw.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from tgruntime.trainer.sampling.draw import _draw, draw
from tgruntime.trainer.sampling.noise import token_salts


def _time(fn: object, iters: int) -> float:
    assert callable(fn)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,32,64,128")
    ap.add_argument("--vocab", default="32000,128256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    print(f"{'rows':>5} {'vocab':>7} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(rows, vocab, device="cuda") * 4
            temperature = torch.ones(rows, device="cuda")
            keys = torch.randint(0, 2**62, (rows,), device="cuda")
            step = torch.full((rows,), 7, dtype=torch.int64, device="cuda")
            salts = token_salts(vocab, logits.device)
            fns = [functools.partial(_draw, logits, None, temperature, keys, step, salts),
                   functools.partial(draw, logits, None, temperature, keys, step)]
            e, c = (_time(fn, args.iters) for fn in fns)
            row = {"rows": rows, "vocab": vocab, "eager_ms": round(e, 4),
                   "compiled_ms": round(c, 4), "speedup": round(e / c, 2)}
            out.append(row)
            print(f"{rows:>5} {vocab:>7} {e:>9.3f} {c:>12.3f} {e / c:>8.1f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
