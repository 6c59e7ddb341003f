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
import time
import uuid
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tgapi

ROOT = Path(__file__).resolve().parents[1]


def spec(tp: int, ckpt: str, preset: str) -> tgapi.TrainerGroupSpec:
    shape = {
        "tiny": dict(
            vocabSize=128,
            hiddenSize=64,
            numLayers=2,
            numAttentionHeads=4,
            ffnHiddenSize=128,
            maxSequenceLength=64,
        ),
        "seed": dict(
            vocabSize=256,
            hiddenSize=2048,
            numLayers=24,
            numAttentionHeads=16,
            ffnHiddenSize=5504,
            maxSequenceLength=1024,
        ),
    }[preset]
    return tgapi.parse_spec(
        {
            "workers": {"processesPerNode": [tp]},
            "parallelism": {"tensor": tp},
            "model": {**shape, "positionEmbedding": "rope"},
            "optimizer": {"lr": 1e-3},
            "training": {
                "batchSize": 4,
                "sequenceLength": shape["maxSequenceLength"],
                "checkpointDir": ckpt,
            },
        },
        local=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=["tiny", "seed"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import ray
    import tinker

    from tgruntime import TrainerClient
    from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
    from tgruntime.service.__main__ import group_info, serve
    from tgruntime.service.auth import KeyStore
    from tgruntime.trainer.worker import MegatronTrainer

    T = tinker.types
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"tinker-bench-{uuid.uuid4().hex[:6]}"
    sp = spec(args.tp, str(tmp), args.preset)
    use_gpu = torch.cuda.is_available()
    ray.init(address="local", include_dashboard=False, namespace=f"bench-{uuid.uuid4().hex[:6]}")
    wg = WorkerGroup.create(
        group_name="bench",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[args.tp], use_gpu=use_gpu, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(sp))),
        detached=False,
        pg_timeout_s=120,
        actor_timeout_s=300,
    )
    wg.init_model()
    client = TrainerClient(wg)
    key = "tml-bench-" + uuid.uuid4().hex
    running = serve(client, group_info("bench", sp), KeyStore(keys=[key]), port=0)
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
    with tinker.ServiceClient(base_url=running.url, api_key=key) as sc:
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
    running.stop()
    wg.teardown()
    ray.shutdown()
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
