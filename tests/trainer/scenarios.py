"""Per-rank bodies of the trainer tests (run in spawned processes by ``tgruntime.trainer.launch``).

Each returns plain data (losses, meshes, checksums) that the tests assert on in the parent.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tgapi

VOCAB, HIDDEN, LAYERS, HEADS, FFN, SEQ, BATCH = 128, 64, 2, 4, 128, 32, 4


def tiny_spec(
    *,
    tp: int = 1,
    pp: int = 1,
    world: int = 2,
    checkpoint_dir: str = "",
    training: dict[str, Any] | None = None,
    **model: Any,
) -> tgapi.TrainerGroupSpec:
    return tgapi.parse_spec(
        {
            "workers": {"useGpu": False, "processesPerNode": [world]},
            "parallelism": {"tensor": tp, "pipeline": pp},
            "model": {
                "vocabSize": VOCAB,
                "hiddenSize": HIDDEN,
                "numLayers": LAYERS,
                "numAttentionHeads": HEADS,
                "ffnHiddenSize": FFN,
                "maxSequenceLength": SEQ,
                **model,
            },
            "optimizer": {"lr": 3e-3, "clipGrad": 1.0, "weightDecay": 0.01},
            "training": {
                "batchSize": BATCH,
                "sequenceLength": SEQ,
                "checkpointDir": checkpoint_dir,
                **(training or {}),
            },
        },
        local=True,
    )


def write_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens ("t0", "t1", ...) saved to ``path``, as
    spec.model.pretrained requires beside the weights (built here, nothing downloaded)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # untyped __init__
        tokenizer_object=tok
    )
    fast.save_pretrained(path)


def fixed_batch(seed: int = 0, batch: int = BATCH) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)


def _run(
    spec: tgapi.TrainerGroupSpec,
    steps: int,
    *,
    data: torch.Tensor,
    save_after: int = 0,
    save_path: str = "",
) -> dict[str, Any]:
    from tgruntime.trainer import TrainEngine

    engine = TrainEngine.create(spec=spec)
    try:
        results, saved = [], None
        for _ in range(steps):
            results.append(engine.train_step(data))
            if save_after and engine.step == save_after:
                saved = engine.save_checkpoint(save_path or None)
        checksum = sum(float(p.detach().double().sum()) for p in engine.state.module.parameters())
        return {
            "mesh": engine.mesh(),
            "losses": [r.loss for r in results],
            "per_sample": [r.per_sample_loss for r in results],
            "grad_norms": [r.grad_norm for r in results],
            "steps": [r.step for r in results],
            "tokens": [r.tokens for r in results],
            "times": [r.step_time_s for r in results],
            "saved": saved,
            "checksum": checksum,
        }
    finally:
        engine.shutdown()


def parallel_suite(*, checkpoint_dir: str) -> dict[str, Any]:
    """TP=2 (checkpoint after step 3), PP=2, DP=2, then a TP=2 variant, in one process group."""
    _quiet()
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    tp_spec = tiny_spec(tp=2, checkpoint_dir=checkpoint_dir)
    init_process_group(resolve_settings(tp_spec))  # owned here, so engines leave it alone
    try:
        out = {"tp": _run(tp_spec, 5, data=fixed_batch(), save_after=3)}
        out["pp"] = _run(tiny_spec(pp=2), 4, data=fixed_batch())
        rank = dist.get_rank()
        # Data parallel: each rank trains on its own half of an 8-sample batch.
        out["dp"] = _run(
            tiny_spec(), 3, data=fixed_batch(batch=2 * BATCH)[rank * BATCH : (rank + 1) * BATCH]
        )
        # The other model branches: CPU-safe RoPE, GQA split over TP (1 group per rank),
        # LayerNorm and GELU.
        variant = tiny_spec(
            tp=2,
            positionEmbedding="rope",
            numQueryGroups=2,
            normalization="LayerNorm",
            activation="gelu",
        )
        out["variant"] = _run(variant, 3, data=fixed_batch())
        return out
    finally:
        dist.destroy_process_group()


def resume(*, checkpoint_dir: str, steps: int) -> dict[str, Any]:
    """A fresh TP=2 job: load the newest checkpoint under checkpoint_dir, then train."""
    _quiet()
    from tgruntime.trainer import TrainEngine

    engine = TrainEngine.create(spec=tiny_spec(tp=2, checkpoint_dir=checkpoint_dir))
    try:
        loaded_step = engine.load_latest_checkpoint()
        results = [engine.train_step(fixed_batch()) for _ in range(steps)]
        return {
            "loaded_step": loaded_step,
            "losses": [r.loss for r in results],
            "steps": [r.step for r in results],
        }
    finally:
        engine.shutdown()


def gpu_train_and_resume(*, checkpoint_dir: str) -> dict[str, Any]:
    """One GPU: bf16 training on a small model, checkpoint after step 3, a fresh engine resumes."""
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    spec = tgapi.parse_spec(
        {
            "workers": {"useGpu": True, "processesPerNode": [1]},
            "model": {
                "vocabSize": 512,
                "hiddenSize": 256,
                "numLayers": 2,
                "numAttentionHeads": 8,
                "numQueryGroups": 4,
                "ffnHiddenSize": 688,
                "maxSequenceLength": 128,
            },
            "optimizer": {"lr": 3e-3},
            "training": {"batchSize": 8, "sequenceLength": 128, "checkpointDir": checkpoint_dir},
        },
        local=True,
    )
    init_process_group(resolve_settings(spec))
    data = torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0))
    try:
        first = TrainEngine.create(spec=spec)
        mesh = first.mesh()
        losses = []
        for _ in range(6):
            losses.append(first.train_step(data).loss)
            if first.step == 3:
                first.save_checkpoint()
        first.shutdown()
        second = TrainEngine.create(spec=spec)
        loaded = second.load_latest_checkpoint()
        resumed = [second.train_step(data).loss for _ in range(3)]
        second.shutdown()
        return {"mesh": mesh, "losses": losses, "loaded": loaded, "resumed": resumed}
    finally:
        dist.destroy_process_group()
