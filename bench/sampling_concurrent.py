"""Concurrent sample requests: the continuous engine against the one-shot path (docs/sampling.md).

One process, no Ray: a ``TrainEngine`` of the preset shape (random weights). ``--requests``
requests of ``--samples`` rows each, prompts of ``--prompt-min``..``--prompt-max`` random
tokens, ``--new`` new tokens at most, a stop token (``--stop-id``: with random weights rows
end at random lengths, as RL rollouts do at EOS). Request ``i`` arrives at ``i * --gap``
seconds (0: a burst, as the cookbook's RL loop sends a step's problems). The paths:

* ``one-shot``: what the service did before: the requests that have arrived go as ONE
  ``Sampler.generate`` call that runs to completion; requests arriving meanwhile wait for
  it (then the next call takes them all);
* ``continuous``: the ``SlotEngine``: arrivals are submitted between chunks of ``--chunk``
  decode steps and join the running batch; finished rows leave at once.

Printed: a table per path (tokens/s of generated tokens, wall seconds, latency p50/p99 from
arrival to completion, decode steps); ``--json`` saves every figure.

    python bench/sampling_concurrent.py --preset seed --device cuda --json out.json
    python bench/sampling_concurrent.py --preset tiny --device cpu --requests 6 --samples 2 \
        --prompt-min 4 --prompt-max 12 --new 16 --gap 0.05
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_step
import tgapi


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _workload(args: argparse.Namespace, vocab: int) -> list[tuple[float, list[int]]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(args.requests):
        n = int(torch.randint(args.prompt_min, args.prompt_max + 1, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        prompt = [t if t != args.stop_id else (t + 1) % vocab for t in prompt]
        out.append((i * args.gap, prompt))
    return out


def _summary(
    name: str, done: dict[int, float], tokens: int, wall: float, extra: dict[str, Any]
) -> dict[str, Any]:
    lat = sorted(done.values())
    return {
        "path": name,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": statistics.median(lat),
        "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        **extra,
    }


def _one_shot(
    sampler: Any,
    work: list[tuple[float, list[int]]],
    params: Any,
    device: str,
    keep: dict[int, Any] | None = None,
) -> Any:
    done: dict[int, float] = {}
    tokens, calls, nxt = 0, 0, 0
    _sync(device)
    t0 = time.perf_counter()
    while nxt < len(work):
        now = time.perf_counter() - t0
        if work[nxt][0] > now:
            time.sleep(work[nxt][0] - now)
            now = time.perf_counter() - t0
        batch = []
        while nxt < len(work) and work[nxt][0] <= now:
            batch.append(nxt)
            nxt += 1
        res = sampler.generate([work[i][1] for i in batch], params)
        _sync(device)
        calls += 1
        end = time.perf_counter() - t0
        for i, r in zip(batch, res, strict=True):
            if keep is not None:
                keep[i] = r
            done[i] = end - work[i][0]
            tokens += sum(len(s["tokens"]) for s in r["sequences"])
    wall = time.perf_counter() - t0
    return _summary("one-shot", done, tokens, wall, {"calls": calls})


def _continuous(
    engine: Any,
    work: list[tuple[float, list[int]]],
    params: Any,
    device: str,
    chunk: int,
    keep: dict[int, Any] | None = None,
) -> Any:
    done: dict[int, float] = {}
    tokens, nxt = 0, 0
    steps0, calls0 = engine.steps, engine.calls
    _sync(device)
    t0 = time.perf_counter()
    while len(done) < len(work):
        now = time.perf_counter() - t0
        if not engine.busy and nxt < len(work) and work[nxt][0] > now:
            time.sleep(work[nxt][0] - now)
            now = time.perf_counter() - t0
        while nxt < len(work) and work[nxt][0] <= now:
            engine.submit(str(nxt), work[nxt][1], params)
            nxt += 1
        for rid, r in engine.run(chunk):
            i = int(rid)
            if keep is not None:
                keep[i] = r
            done[i] = time.perf_counter() - t0 - work[i][0]
            tokens += sum(len(s["tokens"]) for s in r["sequences"])
    _sync(device)
    wall = time.perf_counter() - t0
    extra = {"calls": engine.calls - calls0, "decode_steps": engine.steps - steps0}
    return _summary("continuous", done, tokens, wall, extra)


def run(args: argparse.Namespace) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    import torch

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.sampling import Sampler, SamplingParams
    from tgruntime.trainer.sampling.continuous import SlotEngine
    from tgruntime.trainer.sampling.pool import PoolConfig, PoolSize

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
    sampler = Sampler(engine.state.module, cuda_graphs=gpu)
    d = sampler.decoder
    length = args.prompt_max + args.new
    size = PoolSize.resolve(
        PoolConfig(slots=args.slots or args.requests * args.samples, length=length),
        max_sequence_length=d.max_sequence_length,
        bytes_per_position=2 * len(d.layers) * d.groups * d.head_dim * d.dtype.itemsize,
        free_bytes=torch.cuda.mem_get_info()[0] if gpu else None,
    )
    slots = SlotEngine(d, size, cuda_graphs=gpu)
    params = SamplingParams.build(
        max_tokens=args.new,
        seed=3,
        stop=[[args.stop_id]],
        num_samples=args.samples,
        vocab_size=m.vocab_size,
    )
    work = _workload(args, m.vocab_size)
    out: dict[str, Any] = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "pool": {"slots": size.slots, "length": size.length, "bytes": size.nbytes},
        "runs": [],
    }
    # warm-up: both paths once (graph captures, allocator), not timed; their results are
    # compared row by row (the same seeds: the same tokens unless rounding flips a near-tie)
    a: dict[int, Any] = {}
    b: dict[int, Any] = {}
    _one_shot(sampler, [(0.0, p) for _, p in work], params, device, a)
    _continuous(slots, [(0.0, p) for _, p in work], params, device, args.chunk, b)
    same, rows, worst = 0, 0, 0.0
    for i in a:
        for x, y in zip(a[i]["sequences"], b[i]["sequences"], strict=True):
            rows += 1
            same += x["tokens"] == y["tokens"]
            n = 0
            while n < min(len(x["tokens"]), len(y["tokens"])) and x["tokens"][n] == y["tokens"][n]:
                n += 1
            diffs = [abs(p - q) for p, q in zip(x["logprobs"][:n], y["logprobs"][:n], strict=True)]
            worst = max([worst, *diffs])
    out["agreement"] = {
        "rows": rows,
        "rows_with_identical_tokens": same,
        "max_logprob_diff_on_common_prefix": worst,
    }
    for rep in range(args.reps):
        for fn in ("one-shot", "continuous"):
            if fn == "one-shot":
                r = _one_shot(sampler, work, params, device)
            else:
                r = _continuous(slots, work, params, device, args.chunk)
            r["rep"] = rep
            out["runs"].append(r)
    engine.shutdown()
    return out


def _table(res: dict[str, Any]) -> str:
    a = res["args"]
    g = res["agreement"]
    lines = [
        f"{res['preset']} on {res['device']}: {a['requests']} requests x {a['samples']} samples, "
        f"prompts {a['prompt_min']}-{a['prompt_max']}, new <= {a['new']}, stop id "
        f"{a['stop_id']}, arrivals every {a['gap']} s, chunk {a['chunk']} steps; pool "
        f"{res['pool']['slots']} slots x {res['pool']['length']}",
        f"continuous vs one-shot, same seeds: {g['rows_with_identical_tokens']}/{g['rows']} rows "
        f"with identical tokens, max |logprob diff| on the common prefix "
        f"{g['max_logprob_diff_on_common_prefix']:.2e}",
        "| rep | path | tokens | seconds | tokens/s | latency p50 s | latency p99 s | calls | "
        "decode steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        lines.append(
            f"| {r['rep']} | {r['path']} | {r['tokens']:,} | {r['seconds']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | "
            f"{r['calls']} | {r.get('decode_steps', '')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="seed", choices=sorted(bench_step.PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=256)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--stop-id", type=int, default=1)
    p.add_argument("--gap", type=float, default=0.0, help="seconds between arrivals")
    p.add_argument("--chunk", type=int, default=16, help="decode steps per engine call")
    p.add_argument("--slots", type=int, default=0, help="pool slots (0: requests x samples)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", default="")
    args = p.parse_args()
    res = run(args)
    print(_table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
