"""Per-rank bodies of the RL-primitive tests (spawned by ``tgruntime.trainer.launch``)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

from tests.trainer import reference
from tests.trainer.scenarios import BATCH, SEQ, VOCAB, _quiet, tiny_spec

PPO_CONFIG = {"clip_eps": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.1}


def rl_inputs(seed: int, batch: int = BATCH) -> dict[str, torch.Tensor]:
    """Tokens, a right-padded attention mask, a loss mask, advantages (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    attention_mask = torch.ones(batch, SEQ, dtype=torch.int64)
    attention_mask[0, SEQ - 5 :] = 0  # one right-padded row
    loss_mask = (torch.rand(batch, SEQ - 1, generator=g) > 0.3).float()
    advantages = torch.randn(batch, SEQ - 1, generator=g)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "advantages": advantages,
        "noise_old": 0.3 * torch.randn(batch, SEQ - 1, generator=g),
        "noise_ref": 0.2 * torch.randn(batch, SEQ - 1, generator=g),
    }


def _batch(engine: Any, tensors: dict[str, torch.Tensor]) -> Any:
    from tgruntime.trainer.token_batch import token_batch

    return token_batch(tensors, device=engine.device, vocab_size=VOCAB)


def _full_log_probs(engine: Any, tensors: dict[str, torch.Tensor], *, entropy: bool) -> Any:
    """Log-probs from the last stage, on every rank (the test needs them everywhere)."""
    from megatron.core import parallel_state

    res = engine.compute_log_prob(_batch(engine, tensors), entropy=entropy)
    box = [(res.log_probs, res.entropy)]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    return box[0]


def _policy_tensors(engine: Any, seed: int) -> dict[str, torch.Tensor]:
    raw = rl_inputs(seed)
    logp, _ = _full_log_probs(engine, raw, entropy=False)
    valid = raw["attention_mask"][:, 1:].float()
    out = {k: raw[k] for k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
    out["old_log_probs"] = (logp + raw["noise_old"]) * valid
    out["ref_log_probs"] = (logp + raw["noise_ref"]) * valid
    return out


def _grads(engine: Any) -> dict[str, Any]:
    return reference.rank_shards(engine.state.module, grads=True)


def _model_parallel_case(spec: Any) -> dict[str, Any]:
    from tgruntime.trainer import TrainEngine

    engine = TrainEngine.create(spec=spec)
    try:
        raw = rl_inputs(1)
        logp, ent = _full_log_probs(engine, raw, entropy=True)
        logp_plain, _ = _full_log_probs(engine, raw, entropy=False)
        tensors = _policy_tensors(engine, 2)
        out: dict[str, Any] = {
            "mesh": engine.mesh(),
            "inputs": raw,
            "log_probs": logp,
            "log_probs_plain": logp_plain,
            "entropy": ent,
            "policy": tensors,
            "params": reference.rank_shards(engine.state.module, grads=False),
        }
        for loss, config in (("ppo", PPO_CONFIG), ("importance_sampling", {})):
            engine.zero_grad()
            res = engine.forward_backward(_batch(engine, tensors), loss=loss, loss_config=config)
            out[loss] = {"grads": _grads(engine), "result": res}
        # accumulation over 2 calls == one call on the concatenated batch (grads)
        half_a = {k: v[:2] for k, v in tensors.items()}
        half_b = {k: v[2:] for k, v in tensors.items()}
        engine.zero_grad()
        engine.forward_backward(_batch(engine, half_a), loss="ppo", loss_config=PPO_CONFIG)
        engine.forward_backward(_batch(engine, half_b), loss="ppo", loss_config=PPO_CONFIG)
        out["accumulated"] = _grads(engine)
        return out
    finally:
        engine.shutdown()


def _params_flat(engine: Any) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in engine.state.module.parameters()])


def _dp_accumulation(rank: int) -> dict[str, Any]:
    """DP=2, unequal token counts per call and rank: 2 calls + step == 1 call + step."""
    from tgruntime.trainer import TrainEngine

    spec = tiny_spec()
    # Each rank's own rows of two global batches of 8, masks of different densities.
    a = rl_inputs(10 + rank)
    b = rl_inputs(20 + rank)
    b["loss_mask"][:, : 5 + 7 * rank] = 0.0
    out: dict[str, Any] = {}
    engine = TrainEngine.create(spec=spec)
    try:
        pa, pb = ({k: v for k, v in x.items() if k in ("input_ids", "loss_mask", "advantages")}
                  for x in (a, b))
        for x in (pa, pb):
            x["old_log_probs"] = -5.0 + 0.1 * x["advantages"]
        r1 = engine.forward_backward(_batch(engine, pa), loss="importance_sampling")
        r2 = engine.forward_backward(_batch(engine, pb), loss="importance_sampling")
        out["acc_grads"] = _grads(engine)
        out["acc_tokens"] = (r1.tokens, r2.tokens, r2.accumulated_tokens)
        out["acc_step"] = engine.optim_step()
        out["acc_params"] = _params_flat(engine)
        # per-call override: lr 0 leaves the weights alone and the spec's lr comes back
        before = _params_flat(engine)
        engine.forward_backward(_batch(engine, pa), loss="cross_entropy")
        out["lr0_step"] = engine.optim_step(lr=0.0, grad_clip=0.0)
        out["lr0_unchanged"] = bool(torch.equal(before, _params_flat(engine)))
        out["lr_after"] = float(engine.state.optimizer.param_groups[0]["lr"])
    finally:
        engine.shutdown()
    engine = TrainEngine.create(spec=spec)
    try:
        cat = {k: torch.cat([pa[k], pb[k]]) for k in pa}
        r = engine.forward_backward(_batch(engine, cat), loss="importance_sampling")
        out["one_grads"] = _grads(engine)
        out["one_tokens"] = r.tokens
        out["one_step"] = engine.optim_step()
        out["one_params"] = _params_flat(engine)
    finally:
        engine.shutdown()
    return out


def rl_suite() -> bytes:
    """TP=2, PP=2 (log-probs, PPO / IS gradients, accumulation) and DP=2 accumulation.

    Returned as ``torch.save`` bytes: tensors sent through the launcher's queue as they are
    would be shared by file descriptor, and this process exits before the parent reads them.
    """
    _quiet()
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    init_process_group(resolve_settings(tiny_spec(tp=2)))
    try:
        out = {
            "tp": _model_parallel_case(tiny_spec(tp=2)),
            "pp": _model_parallel_case(tiny_spec(pp=2)),
            "dp": _dp_accumulation(dist.get_rank()),
        }
        buffer = io.BytesIO()
        torch.save(out, buffer)
        return buffer.getvalue()
    finally:
        dist.destroy_process_group()
