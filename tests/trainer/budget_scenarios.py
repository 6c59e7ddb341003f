"""Per-rank body of the token-budget tests (spawned by ``tgruntime.trainer.launch``): one call
split by the budget against the same call in one piece and against budget-sized calls."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch

from tests.trainer.rl_scenarios import _batch, _full_log_probs, rl_inputs
from tests.trainer.scenarios import SEQ, _quiet, tiny_spec
from tests.trainer.soft_scenarios import _flat, _max_diff, soft_checks

ROWS = 10
BUDGET = 2 * SEQ  # two full rows per micro-batch: the call below is 5x the budget
# Mixed lengths, as an RL call sends them: longest first, the two long rows fill one
# micro-batch of 32 tokens' width, the eight short ones two of 16 (WIDTH_QUANTUM)
LENGTHS = (32, 6, 9, 5, 12, 30, 7, 4, 10, 8)
LOSSES: dict[str, dict[str, Any]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_eps": 0.2},
    "tinker_cross_entropy": {},
    "tinker_importance_sampling": {},
    "tinker_ppo": {},
    "tinker_cispo": {},
    "tinker_dro": {"beta": 0.1},
}


def _rows(t: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    return {k: v[lo:hi] for k, v in t.items()}


def budget_suite() -> bytes:
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.token_budget import TokenBudgetError

    spec = tiny_spec(tp=2)
    spec = dataclasses.replace(
        spec, training=dataclasses.replace(spec.training, micro_batch_tokens=BUDGET)
    )
    engine = TrainEngine.create(spec=spec)
    out: dict[str, Any] = {"budget": engine._token_budget, "source": engine._token_budget_source}
    try:
        raw = rl_inputs(5, batch=ROWS)
        for row, length in enumerate(LENGTHS):
            raw["attention_mask"][row] = (torch.arange(SEQ) < length).long()
        engine._token_budget = 0
        whole_lp, _ = _full_log_probs(engine, raw, entropy=False)
        engine._token_budget = BUDGET
        split_lp, _ = _full_log_probs(engine, raw, entropy=False)
        out["log_prob_diff"] = float((whole_lp - split_lp).abs().max())
        # each row alone, in request order: the split's rows come back where they were sent
        alone = torch.cat([_full_log_probs(engine, _rows(raw, i, i + 1), entropy=False)[0]
                           for i in range(ROWS)])
        out["log_prob_diff_alone"] = float((alone - split_lp).abs().max())
        valid = raw["attention_mask"][:, 1:].float()
        tensors = {k: raw[k] for k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
        tensors["old_log_probs"] = (whole_lp + raw["noise_old"]) * valid
        batch = _batch(engine, tensors)
        engine._token_budget = BUDGET
        micro = engine._micro(batch)[0]
        out["micro_shapes"] = [tuple(m.tokens.shape) for m in micro]
        for name, config in LOSSES.items():
            for reduction in ("sum", "mean"):
                engine._token_budget = BUDGET
                engine.zero_grad()
                split = engine.forward_backward(
                    batch, loss=name, loss_config=config, reduction=reduction
                )
                g_split = _flat(engine)
                engine._token_budget = 0
                engine.zero_grad()
                whole = engine.forward_backward(
                    batch, loss=name, loss_config=config, reduction=reduction
                )
                g_whole = _flat(engine)
                engine._token_budget = BUDGET
                engine.zero_grad()
                parts = [
                    engine.forward_backward(
                        _batch(engine, _rows(tensors, i, i + 2)), loss=name,
                        loss_config=config, reduction=reduction,
                    )
                    for i in range(0, ROWS, 2)
                ]
                g_parts = _flat(engine)
                out[f"{name}/{reduction}"] = {
                    "split": split.loss,
                    "whole": whole.loss,
                    "parts": (
                        sum(p.loss * p.tokens for p in parts) / sum(p.tokens for p in parts)
                        if reduction == "mean" else sum(p.loss for p in parts)
                    ),
                    "per_sample_split": list(split.per_sample_loss),
                    "per_sample_whole": list(whole.per_sample_loss),
                    "per_sample_parts": [x for p in parts for x in p.per_sample_loss],
                    "grad_split_vs_whole": _max_diff(g_split, g_whole),
                    "grad_parts_vs_whole": _max_diff(g_parts, g_whole),
                    "grad_scale": max(float(g.abs().max()) for g in g_whole.values()),
                }
        out["soft"] = soft_checks(engine, BUDGET)
        # a row longer than the budget: refused with the numbers, the engine stays usable
        engine._token_budget = SEQ // 2
        engine.zero_grad()
        try:
            engine.forward_backward(batch, loss="cross_entropy")
            out["refused"] = None
        except TokenBudgetError as exc:
            out["refused"] = str(exc)
        engine._token_budget = BUDGET
        out["after_refusal"] = engine.forward_backward(batch, loss="cross_entropy").loss
        engine.optim_step()
    finally:
        engine.shutdown()
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()
