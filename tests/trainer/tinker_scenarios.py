"""Per-rank body of the Tinker-semantics test (TP=2, CPU, gloo; spawned by ``launch``).

One engine: ``export_hf`` of its initial weights; for each Tinker loss, ``forward_backward``
with ``reduction="sum"`` on the whole batch, then on its two halves (gradients compared in
the parent); then ``optim_step`` with per-step Adam parameters against torch's AdamW, and
``load_checkpoint(optimizer=False)``. Returned as ``torch.save`` bytes.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from tests.trainer import reference
from tests.trainer.scenarios import BATCH, SEQ, VOCAB, _quiet, tiny_spec

MODEL = {"positionEmbedding": "rope", "numQueryGroups": 2}
LOSSES: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.5},
    "gspo": {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03},
}
ADAM: dict[str, Any] = {
    "lr": 1e-2,
    "betas": (0.5, 0.7),
    "eps": 1e-6,
    "weight_decay": 0.0,
    "grad_clip": 0.0,
}


def tinker_inputs(seed: int = 5) -> dict[str, torch.Tensor]:
    """One Datum per row: tokens, unshifted random targets, weights, advantages, padding."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    attention_mask[1, SEQ - 6 :] = 0  # a shorter datum, right-padded
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "target_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "attention_mask": attention_mask,
        "loss_mask": torch.rand(BATCH, SEQ, generator=g),
        "advantages": torch.randn(BATCH, SEQ, generator=g),
        "noise": 0.3 * torch.randn(BATCH, SEQ, generator=g),
        # gspo's sequence ratio: the marked tokens of each datum (drawn last: the other
        # inputs keep their values)
        "sequence_ratio_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.3).float() * attention_mask,
    }


def _rows(t: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {k: v[lo:hi] for k, v in t.items()}


def _case(engine: Any, batch_fn: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, config in LOSSES.items():
        loss = f"tinker_{name}"
        engine.zero_grad()
        whole = engine.forward_backward(
            batch_fn(tensors), loss=loss, loss_config=config, reduction="sum"
        )
        grads_whole = reference.rank_shards(engine.state.module, grads=True)
        engine.zero_grad()
        half = BATCH // 2
        first = engine.forward_backward(
            batch_fn(_rows(tensors, 0, half)), loss=loss, loss_config=config, reduction="sum"
        )
        second = engine.forward_backward(
            batch_fn(_rows(tensors, half, BATCH)), loss=loss, loss_config=config, reduction="sum"
        )
        grads_split = reference.rank_shards(engine.state.module, grads=True)
        out[name] = {
            "loss": whole.loss,
            "per_sample": whole.per_sample_loss,
            "log_probs": whole.log_probs,
            "halves": (first.loss, second.loss),
            "accumulated_tokens": second.accumulated_tokens,
            "grads_whole": grads_whole,
            "grads_split": grads_split,
        }
    return out


def _adam_and_load(engine: Any, batch_fn: Any, tensors: dict[str, Any], path: str) -> Any:
    """Two steps with per-step Adam parameters against torch's AdamW on copies of the
    weights; then a weights-only load."""
    params = [p for p in engine.state.module.parameters()]
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    ref = torch.optim.AdamW(
        copies, lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"], weight_decay=0.0
    )
    mixed_error = ""
    for _ in range(2):
        engine.zero_grad()
        engine.forward_backward(batch_fn(tensors), loss="tinker_cross_entropy", reduction="sum")
        try:
            engine.forward_backward(batch_fn(tensors), loss="tinker_cross_entropy")
        except ValueError as exc:
            mixed_error = str(exc)
        for c, p in zip(copies, params, strict=True):
            c.grad = p.grad.detach().clone()
        engine.optim_step(**ADAM)
        ref.step()
    max_diff = max(float((c - p).abs().max()) for c, p in zip(copies, params, strict=True))
    groups = [(g["lr"], g["betas"], g["eps"]) for g in engine.state.optimizer.param_groups]
    saved = engine.save_checkpoint(path)
    weights = [p.detach().clone() for p in params]
    engine.zero_grad()
    engine.forward_backward(batch_fn(tensors), loss="tinker_cross_entropy", reduction="sum")
    engine.optim_step(**ADAM)
    moved = max(float((w - p).abs().max()) for w, p in zip(weights, params, strict=True))
    engine.load_checkpoint(saved, optimizer=False)
    restored = max(float((w - p).abs().max()) for w, p in zip(weights, params, strict=True))
    fresh = len(engine.state.optimizer.optimizer.state)
    engine.load_checkpoint(saved, optimizer=True)
    return {
        "adam_max_diff": max_diff,
        "groups_after": groups,
        "mixed_error": mixed_error,
        "moved": moved,
        "restored_diff": restored,
        "state_after_weights_only": fresh,
        "state_after_full": len(engine.state.optimizer.optimizer.state),
    }


def tinker_suite(hf_dir: str, ckpt_dir: str) -> bytes:
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.hf_worker import export_hf_checkpoint
    from tgruntime.trainer.token_batch import token_batch

    engine = TrainEngine.create(spec=tiny_spec(tp=2, **MODEL))  # type: ignore[arg-type]
    try:

        def batch_fn(t: dict[str, torch.Tensor]) -> Any:
            sent = {k: v for k, v in t.items() if k != "noise"}
            return token_batch(sent, device=engine.device, vocab_size=VOCAB)

        export_hf_checkpoint(engine, path=hf_dir)
        raw = tinker_inputs()
        lp = engine.compute_log_prob(batch_fn(raw))
        assert lp.log_probs is not None  # TP=2, PP=1: every rank is on the last stage
        tensors = dict(raw)
        tensors["old_log_probs"] = (lp.log_probs + raw["noise"]) * raw["attention_mask"]
        out = {
            "inputs": tensors,
            "log_probs": lp.log_probs,
            "losses": _case(engine, batch_fn, tensors),
            "adam": _adam_and_load(engine, batch_fn, tensors, ckpt_dir),
        }
        buffer = io.BytesIO()
        torch.save(out, buffer)
        return buffer.getvalue()
    finally:
        engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def _main_grads(module: torch.nn.Module) -> list[torch.Tensor]:
    """Accumulated gradients: megatron DDP's fp32 ``main_grad`` buffers on a GPU."""
    out = []
    for p in module.parameters():
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        assert g is not None
        out.append(g.detach().float().clone())
    return out


def tinker_gpu_suite(ckpt_dir: str) -> dict[str, Any]:
    """One GPU, bf16, megatron's DDP and optimizer: sum reduction accumulates without
    rescaling, per-step betas/eps are applied and restored, a weights-only load re-copies
    megatron's fp32 main params (an lr=0 step after it keeps the loaded weights)."""
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.token_batch import token_batch

    spec = tiny_spec(world=1, **MODEL)  # type: ignore[arg-type]
    engine = TrainEngine.create(spec=spec, device="cuda")
    try:

        def batch_fn(t: dict[str, torch.Tensor]) -> Any:
            sent = {k: v for k, v in t.items() if k != "noise"}
            return token_batch(sent, device=engine.device, vocab_size=VOCAB)

        raw = tinker_inputs()
        lp = engine.compute_log_prob(batch_fn(raw)).log_probs
        assert lp is not None
        tensors = dict(raw)
        tensors["old_log_probs"] = (lp + raw["noise"]) * raw["attention_mask"]
        module = engine.state.module
        engine.zero_grad()
        whole = engine.forward_backward(batch_fn(tensors), loss="tinker_ppo", reduction="sum")
        g_whole = _main_grads(module)
        engine.zero_grad()
        for lo, hi in ((0, BATCH // 2), (BATCH // 2, BATCH)):
            engine.forward_backward(
                batch_fn(_rows(tensors, lo, hi)), loss="tinker_ppo", reduction="sum"
            )
        g_split = _main_grads(module)
        rel = max(
            float((a - b).norm() / b.norm().clamp(min=1e-12))
            for a, b in zip(g_split, g_whole, strict=True)
        )
        step = engine.optim_step(**ADAM)
        groups = [(g["lr"], g["betas"], g["eps"]) for g in engine.state.optimizer.param_groups]
        saved = engine.save_checkpoint(ckpt_dir)
        weights = [p.detach().clone() for p in module.parameters()]
        engine.forward_backward(batch_fn(tensors), loss="tinker_cross_entropy", reduction="sum")
        engine.optim_step(**ADAM)
        moved = max(
            float((w - p).abs().max()) for w, p in zip(weights, module.parameters(), strict=True)
        )
        engine.load_checkpoint(saved, optimizer=False)
        engine.forward_backward(batch_fn(tensors), loss="tinker_cross_entropy", reduction="sum")
        engine.optim_step(lr=0.0, weight_decay=0.0, grad_clip=0.0)
        kept = max(
            float((w - p).abs().max()) for w, p in zip(weights, module.parameters(), strict=True)
        )
        return {
            "loss": whole.loss,
            "grad_rel_diff": rel,
            "grad_norm": step.grad_norm,
            "groups_after": groups,
            "moved": moved,
            "kept_after_weights_only": kept,
        }
    finally:
        engine.shutdown()
