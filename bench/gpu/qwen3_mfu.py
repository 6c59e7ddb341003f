"""MFU of a Qwen3-shaped model loaded through ``spec.model.pretrained``, on one GPU (issue 22).

``transformers`` builds a random Qwen3 (Qwen3-1.7B's shape by default: hidden 2048, 28 layers,
16 heads of 128, 8 key/value heads, ffn 6144, vocab 151936, tied embeddings, q/k norms) and
saves it with ``save_pretrained``; the spec names that directory as ``model.pretrained`` (the
shape comes from its config.json), the engine imports it (``import_hf_checkpoint``, as the
worker's ``init_model`` does) and takes training steps. MFU: megatron's FLOPs formula over the
GPU's measured bf16 matmul rate. Prints a table and writes JSON.

    python bench/gpu/qwen3_mfu.py --dir /tmp/qwen3 --batch 8 --seq 2048 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # bench/

QWEN3_1_7B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


TINY = {  # a CPU smoke run of this script (--tiny)
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64,
}


def write_model(path: Path, layers: int, *, tiny: bool) -> float:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    start = time.perf_counter()
    # Any: config fields of several types (torch_dtype reaches PretrainedConfig's **kwargs)
    shape: dict[str, Any] = {**QWEN3_1_7B, **(TINY if tiny else {}), "num_hidden_layers": layers}
    shape["torch_dtype"] = "bfloat16"
    config = Qwen3Config(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        # transformers' decorator on .to() hides its signature from mypy
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(str(path))
    sys.path.insert(0, str(HERE.parents[1]))  # the repository: tests' tokenizer writer
    from tests.trainer.scenarios import write_tokenizer

    write_tokenizer(path, config.vocab_size)  # spec.model.pretrained wants one beside it
    del model
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def _rank(*, spec_wire: dict[str, Any], steps: int, warmup: int) -> Any:
    warnings.filterwarnings("ignore")
    import tgapi
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.hf_worker import import_hf_checkpoint
    from tgruntime.trainer.steptime import matmul_tflops, time_engine_steps

    spec = tgapi.parse_spec(spec_wire, local=True)
    engine = TrainEngine.create(spec=spec)
    try:
        start = time.perf_counter()
        assert spec.model.pretrained
        import_hf_checkpoint(engine, path=spec.model.pretrained)
        loaded = time.perf_counter() - start
        out = time_engine_steps(engine, steps=steps, warmup=warmup)
    finally:
        engine.shutdown()
    out["import_s"] = loaded
    if engine.settings.on_gpu:
        out["matmul_tflops"] = matmul_tflops()
    return out


def main() -> int:
    import tgapi
    from bench_step import summarize_ranks
    from tgruntime.trainer.launch import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/qwen3")
    p.add_argument("--layers", type=int, default=QWEN3_1_7B["num_hidden_layers"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--tiny", action="store_true", help="a small shape, for a CPU smoke run")
    a = p.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    path = Path(a.dir)
    written = write_model(path, a.layers, tiny=a.tiny)
    spec = tgapi.parse_spec(
        {
            "workers": {"useGpu": gpu, "processesPerNode": [1]},
            "model": {
                "pretrained": str(path),
                "dtype": "bfloat16" if gpu else "float32",
                "positionEmbedding": "rope",
            },
            "optimizer": {"lr": 1e-5, "clipGrad": 1.0},
            "training": {"batchSize": a.batch, "sequenceLength": a.seq},
        },
        local=True,
    )
    ranks = launch(
        _rank,
        world_size=1,
        kwargs={"spec_wire": tgapi.to_wire(spec), "steps": a.steps, "warmup": a.warmup},
        timeout_s=900,
    )
    row = summarize_ranks(spec, ranks, path="direct", steps=a.steps, warmup=a.warmup)
    m = spec.model
    row.update(
        architecture=m.architecture,
        written_s=written,
        import_s=ranks[0]["import_s"],
        tie_embeddings=m.tie_embeddings,
        head_dim=m.head_dim,
    )
    print(f"Qwen3 ({m.architecture}, {m.num_layers} layers, hidden {m.hidden_size}, heads "
          f"{m.num_attention_heads}x{m.head_dim}, kv {m.num_query_groups}, vocab {m.vocab_size}, "
          f"tied {m.tie_embeddings}) on {row.get('gpu_name')}")
    head = f"{'params':>14} {'step ms':>9} {'tokens/s':>10} {'TFLOP/s':>9} {'MFU':>6}"
    print(f"{head} {'peak GiB':>9}")
    print(f"{row['parameters']:>14,} {1e3 * row['step_s']['median']:>9.1f} "
          f"{row['tokens_per_s']:>10.0f} {row['achieved_tflops']:>9.1f} "
          f"{row.get('mfu', 0.0):>6.3f} {row.get('peak_memory_gib', 0.0):>9.2f}")
    print(f"written in {written:.1f} s, imported in {row['import_s']:.1f} s, "
          f"loss {row['first_loss']:.3f} -> {row['final_loss']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
