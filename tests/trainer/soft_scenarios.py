"""Per-rank body of the soft-target checks (run inside ``budget_scenarios.budget_suite``, on
its TP=2 engine): ``[B, S, K]`` targets in one pass against the same targets as K rows of
``[B, S]`` each, the form the service sent before (and the definition of the loss)."""

from __future__ import annotations

from typing import Any

import torch

from tests.trainer.rl_scenarios import _batch
from tests.trainer.scenarios import SEQ, VOCAB

ROWS, K = 5, 3
LENGTHS = (32, 7, 20, 3, 12)


def _flat(engine: Any) -> dict[str, torch.Tensor]:  # every parameter's gradient (a copy)
    return {n: p.grad.detach().clone() for n, p in engine.state.module.named_parameters()
            if p.grad is not None}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _inputs() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The soft batch and the same as K rows per row (row ``k * ROWS + i`` is column ``k``)."""
    g = torch.Generator().manual_seed(38)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.stack([(torch.arange(SEQ) < n).long() for n in LENGTHS])
    target = torch.randint(0, VOCAB, (ROWS, SEQ, K), generator=g)
    target[1, :, 2] = target[1, :, 0]  # a repeated id: its two weights add up
    weights = torch.rand((ROWS, SEQ, K), generator=g)
    weights[2, 4:9] = 0.0
    soft = {"input_ids": ids, "attention_mask": mask, "target_ids": target,
            "target_weights": weights}
    rows = {
        "input_ids": ids.repeat(K, 1),
        "attention_mask": mask.repeat(K, 1),
        "target_ids": torch.cat([target[..., k] for k in range(K)]),
        "loss_mask": torch.cat([weights[..., k] for k in range(K)]),
    }
    return soft, rows


def _as_columns(lp: torch.Tensor) -> torch.Tensor:
    """K rows' log-probs [K * ROWS, S] -> [ROWS, S, K]."""
    return torch.stack(list(lp.reshape(K, ROWS, -1)), dim=-1)


def soft_checks(engine: Any, budget: int) -> dict[str, Any]:
    soft_t, rows_t = _inputs()
    soft, rows = _batch(engine, soft_t), _batch(engine, rows_t)
    out: dict[str, Any] = {}
    engine._token_budget = 0
    lp_rows = engine.compute_log_prob(rows).log_probs
    lp_soft = engine.compute_log_prob(soft).log_probs
    if lp_soft is not None:  # the last pipeline stage
        out["logprob_shape"] = tuple(lp_soft.shape)
        out["logprob_diff"] = float((lp_soft - _as_columns(lp_rows)).abs().max())
    for reduction in ("sum", "mean"):
        results = {}
        for name, batch, tokens in (("rows", rows, 0), ("soft", soft, 0),
                                    ("soft_split", soft, budget)):
            engine._token_budget = tokens
            engine.zero_grad()
            r = engine.forward_backward(batch, loss="tinker_cross_entropy", reduction=reduction)
            results[name] = (r, _flat(engine))
        (r_rows, g_rows), (r_soft, g_soft), (r_split, g_split) = results.values()
        out[reduction] = {
            "loss_rows": r_rows.loss,
            "loss_soft": r_soft.loss,
            "loss_split": r_split.loss,
            "tokens": (r_rows.tokens, r_soft.tokens),
            "per_sample_rows": torch.tensor(r_rows.per_sample_loss).reshape(K, ROWS).sum(0)
            if reduction == "sum" else None,
            "per_sample_soft": list(r_soft.per_sample_loss),
            "grad_soft_vs_rows": _max_diff(g_soft, g_rows),
            "grad_split_vs_rows": _max_diff(g_split, g_rows),
            "grad_scale": max(float(g.abs().max()) for g in g_rows.values()),
            "fb_logprob_diff": (
                float((r_soft.log_probs - _as_columns(r_rows.log_probs)).abs().max())
                if r_soft.log_probs is not None else 0.0
            ),
        }
    engine.zero_grad()
    try:
        engine.forward_backward(soft, loss="tinker_importance_sampling", reduction="sum")
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    engine._token_budget = budget
    engine.zero_grad()
    return out
