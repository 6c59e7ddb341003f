"""Tinker's ``gspo`` and ``stable_reinforce`` (issue 38), and ``forward``'s ``loss:sum``.

Pure torch, no Ray: ``gspo`` against a float64 reference written from Tinker's "GSPO" page
(sequence ratio ``s = exp(mean over sequence_ratio_mask of (logp - q))``; every token carries
``s``'s value with its own log-prob's gradient, so ``d s_t / d logp_t = s``; then PPO's clipped
objective per token), loss and gradient, through the registered loss function and through the
trainer's own loss step (``token_steps._pg_loss`` on a ``token_batch``); the service's datum
checks for ``sequence_ratio_mask``; ``custom`` refused (``stable_reinforce``:
test_stable_reinforce_loss.py); the loss the server reports for ``forward``
(``datum.forward_loss``) for every loss.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from tgruntime.service.codec import DatumIn
from tgruntime.service.datum import forward_loss, to_tensors
from tgruntime.service.sessions import ServiceError
from tgruntime.trainer.loss_catalog import resolve_loss
from tgruntime.trainer.losses import TokenTensors
from tgruntime.trainer.tinker_losses import TINKER_LOSSES, tinker_loss_name

F64 = torch.float64


def _inputs(seed: int = 0, b: int = 3, t: int = 7) -> dict[str, torch.Tensor]:
    """Off-policy rows: ratios well away from 1, mixed-sign advantages, partial masks; row 2's
    sequence_ratio_mask marks nothing (its ratio is 1)."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.1
    q = logp + (torch.rand(b, t, generator=g, dtype=F64) - 0.5) * 1.2
    adv = torch.randn(b, t, generator=g, dtype=F64)
    weights = (torch.rand(b, t, generator=g, dtype=F64) > 0.2).to(F64)
    weights[0, 0] = 0.5  # a fractional weight
    mask = torch.zeros(b, t, dtype=F64)
    mask[0, 2:] = 1.0
    mask[1, :5] = 2.0  # any non-zero value marks a token
    return {
        "logp": logp,
        "old_log_probs": q,
        "advantages": adv,
        "loss_mask": weights,
        "sequence_ratio_mask": mask,
    }


def _gspo_reference(
    x: dict[str, torch.Tensor], lo: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-datum weighted loss sums and d(total)/d(logp), by hand in float64, row by row."""
    logp, q, adv = x["logp"].tolist(), x["old_log_probs"].tolist(), x["advantages"].tolist()
    w, mask = x["loss_mask"].tolist(), x["sequence_ratio_mask"].tolist()
    sums, grads = [], []
    for i in range(len(logp)):
        marked = [j for j, m in enumerate(mask[i]) if m != 0]
        mean = sum(logp[i][j] - q[i][j] for j in marked) / len(marked) if marked else 0.0
        s = math.exp(mean)
        c = min(max(s, lo), hi)
        row_sum, row_grad = 0.0, []
        for j in range(len(logp[i])):
            a = adv[i][j]
            row_sum += -min(s * a, c * a) * w[i][j]
            # the unclipped branch's gradient is s*A; the clipped one's is s*A inside [lo, hi],
            # 0 outside (clamp is flat there)
            unclipped_wins = s * a < c * a
            row_grad.append(-s * a * w[i][j] if unclipped_wins or lo < s < hi else 0.0)
        sums.append(row_sum)
        grads.append(row_grad)
    return torch.tensor(sums, dtype=F64), torch.tensor(grads, dtype=F64)


def _batch(x: dict[str, torch.Tensor], dtype: torch.dtype = F64) -> TokenTensors:
    return TokenTensors({k: v.to(dtype) for k, v in x.items() if k != "logp"}, loss="test")


CONFIGS: list[dict[str, Any]] = [
    {},  # Tinker's defaults: 0.8, 1.2
    {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
    {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0},  # nothing clipped
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_loss_and_gradient_against_the_float64_reference(
    config: dict[str, Any], seed: int
) -> None:
    x = _inputs(seed)
    lo = config.get("clip_low_threshold", 0.8)
    hi = config.get("clip_high_threshold", 1.2)
    want_sums, want_grad = _gspo_reference(x, lo, hi)
    lp = x["logp"].clone().requires_grad_(True)
    per_token, metrics = resolve_loss(tinker_loss_name("gspo")).fn(lp, _batch(x), config)
    weighted = per_token * x["loss_mask"]
    torch.testing.assert_close(weighted.sum(1).detach(), want_sums, atol=1e-12, rtol=1e-12)
    (grad,) = torch.autograd.grad(weighted.sum(), lp)
    torch.testing.assert_close(grad, want_grad, atol=1e-12, rtol=1e-12)
    # every token of a row carries the sequence ratio; row 2 marks nothing: ratio 1
    ratio = metrics["ratio"]
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio))
    assert torch.all(ratio[2] == 1.0)


def test_gspo_clips_whole_sequences_and_the_cases_differ_from_ppo() -> None:
    """A row whose every token ratio is e^0.5 = 1.65 but whose mean log-ratio is ~0 is not
    clipped by gspo (s ~ 1), though ppo clips each of its tokens."""
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    q = torch.tensor([[-1.5, -0.5, -1.5, -0.5]], dtype=F64)  # log-ratios +-0.5: mean 0
    x = {
        "logp": logp,
        "old_log_probs": q,
        "advantages": torch.ones(1, 4, dtype=F64),
        "loss_mask": torch.ones(1, 4, dtype=F64),
        "sequence_ratio_mask": torch.ones(1, 4, dtype=F64),
    }
    gspo, _ = resolve_loss("tinker_gspo").fn(logp, _batch(x), {})
    assert gspo.tolist()[0] == pytest.approx([-1.0] * 4, abs=1e-15)
    ppo, _ = resolve_loss("tinker_ppo").fn(logp, _batch(x), {})
    assert ppo.tolist()[0] == pytest.approx([-1.2, -math.exp(-0.5), -1.2, -math.exp(-0.5)])


@pytest.mark.megatron
@pytest.mark.parametrize("config", CONFIGS[:2])
def test_gspo_through_the_trainers_loss_step(config: dict[str, Any]) -> None:
    """What the workers run: ``token_batch`` (explicit targets, right padding) then
    ``_pg_loss`` on the model's per-token cross-entropy, in the trainer's float32."""
    pytest.importorskip("megatron.core")
    from tgruntime.trainer.token_batch import token_batch
    from tgruntime.trainer.token_steps import _pg_loss

    x = _inputs(3, b=3, t=6)
    attention = torch.ones(3, 6, dtype=torch.int64)
    attention[1, 4:] = 0  # row 1 is 4 tokens long: padding carries no weight, no ratio
    for key in ("loss_mask", "sequence_ratio_mask"):
        x[key] = x[key] * attention
    b = token_batch(
        {
            "input_ids": torch.ones(3, 6, dtype=torch.int64),
            "target_ids": torch.ones(3, 6, dtype=torch.int64),
            "attention_mask": attention,
            **{k: v.to(torch.float32) for k, v in x.items() if k != "logp"},
        },
        device=torch.device("cpu"),
        vocab_size=8,
    )
    output = (-x["logp"]).to(torch.float32).requires_grad_(True)  # per-token CE
    spec = resolve_loss(tinker_loss_name("gspo"))
    loss, reported = _pg_loss(b, spec, config, 1.0, output)
    want_sums, want_grad = _gspo_reference(
        x, config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    )
    assert float(loss.detach()) == pytest.approx(float(want_sums.sum()), rel=1e-5, abs=1e-5)
    torch.testing.assert_close(
        reported["sample_loss_sum"].double(), want_sums, atol=1e-5, rtol=1e-5
    )
    (grad_output,) = torch.autograd.grad(loss, output)
    torch.testing.assert_close(-grad_output.double(), want_grad, atol=1e-5, rtol=1e-5)


# -- the service: names, datum checks, forward's loss:sum ----------------------------------
def test_gspo_and_stable_reinforce_are_served_and_custom_is_refused() -> None:
    assert {"gspo", "stable_reinforce"} <= set(TINKER_LOSSES)
    assert resolve_loss(tinker_loss_name("gspo")).name == "tinker_gspo"
    with pytest.raises(ValueError, match="forward_backward_custom"):
        tinker_loss_name("custom")


def _datum(n: int, **extra: np.ndarray) -> DatumIn:
    g = np.random.default_rng(n)
    inputs: dict[str, np.ndarray] = {
        "target_tokens": g.integers(0, 16, n).astype(np.int64),
        "logprobs": -g.random(n).astype(np.float32),
        "advantages": g.standard_normal(n).astype(np.float32),
        **extra,
    }
    return DatumIn(g.integers(0, 16, n).astype(np.int64), inputs)


def test_gspo_datums_need_a_per_token_sequence_ratio_mask() -> None:
    kw: dict[str, Any] = {"loss": "gspo", "vocab_size": 16, "max_len": 64, "dp": 2}
    with pytest.raises(ServiceError, match=r"loss 'gspo' needs loss_fn_inputs\['sequence_ratio"):
        to_tensors([_datum(4)], **kw)
    with pytest.raises(ServiceError, match=r"'sequence_ratio_mask'\] has shape \[3\]"):
        to_tensors([_datum(4, sequence_ratio_mask=np.ones(3, np.float32))], **kw)
    mask = np.asarray([0, 1, 1, 0], np.float32)
    batch, lengths = to_tensors(
        [_datum(4, sequence_ratio_mask=mask), _datum(2, sequence_ratio_mask=mask[:2])], **kw
    )
    assert lengths == [4, 2] and tuple(batch["sequence_ratio_mask"].shape) == (2, 4)
    assert batch["sequence_ratio_mask"].tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]


LOSS_CONFIGS: dict[str, dict[str, Any]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9},
    "cispo": {},
    "dro": {"beta": 0.1},
    "gspo": {},
}


def _reference_total(name: str, x: dict[str, torch.Tensor], w: torch.Tensor) -> float:
    """Tinker's per-token formulas once more, in float64, summed with the weights."""
    logp, q, a = x["logp"], x["old_log_probs"], x["advantages"]
    r = torch.exp(logp - q)
    lo, hi = LOSS_CONFIGS[name].get("clip_low_threshold", 0.8), 1.2
    if name == "cross_entropy":
        per = -logp
    elif name == "importance_sampling":
        per = -r * a
    elif name == "ppo":
        per = -torch.minimum(r * a, r.clamp(lo, hi) * a)
    elif name == "cispo":
        per = -r.clamp(lo, hi) * logp * a
    elif name == "dro":
        per = -(logp * a - 0.05 * (logp - q) ** 2)
    else:
        return float(_gspo_reference({**x, "loss_mask": w}, lo, hi)[0].sum())
    return float((per * w).sum())


@pytest.mark.parametrize("name", sorted(LOSS_CONFIGS))
def test_forward_reports_the_loss_of_every_loss(name: str) -> None:
    """``forward`` (forward_only) runs no loss on the group; the server computes ``loss:sum``
    from the group's log-probs with the same registered loss (it was 0.0 for all but
    cross_entropy)."""
    x = _inputs(5, b=2, t=5)
    attention = torch.ones(2, 5, dtype=torch.int64)
    attention[1, 3:] = 0
    batch = {
        "input_ids": torch.zeros(2, 5, dtype=torch.int64),
        "target_ids": torch.zeros(2, 5, dtype=torch.int64),
        "attention_mask": attention,
        **{k: v.to(torch.float32) * attention for k, v in x.items() if k != "logp"},
    }
    lp32 = (x["logp"] * attention).to(torch.float32)
    got = forward_loss(tinker_loss_name(name), lp32, batch, LOSS_CONFIGS[name])
    ref_x = {k: v.to(torch.float32).double() for k, v in x.items()}
    ref_x = {k: v * attention for k, v in ref_x.items()}
    want = _reference_total(name, ref_x, ref_x["loss_mask"])
    assert got != 0.0
    assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_forward_loss_refuses_a_bad_config_like_forward_backward() -> None:
    x = {k: v[:1] for k, v in _inputs(6, b=2, t=3).items()}
    batch = {
        "input_ids": torch.zeros(1, 3, dtype=torch.int64),
        "target_ids": torch.zeros(1, 3, dtype=torch.int64),
        "attention_mask": torch.ones(1, 3, dtype=torch.int64),
        **{k: v.to(torch.float32) for k, v in x.items() if k != "logp"},
    }
    with pytest.raises(ValueError, match=r"needs loss_config\['beta'\]"):
        forward_loss("tinker_dro", x["logp"].to(torch.float32), batch, {})


def test_clip_thresholds_from_the_datums_reach_the_loss() -> None:
    """Tinker's datums may carry clip_low/high_threshold: one value or one per token; they
    override loss_fn_config (they used to be accepted and dropped)."""
    kw: dict[str, Any] = {"loss": "ppo", "vocab_size": 16, "max_len": 64, "dp": 1}
    one = np.asarray([1.05], np.float32)
    per_token = np.asarray([1.1, 1.2, 5.0], np.float32)
    batch, _ = to_tensors(
        [_datum(4, clip_high_threshold=one), _datum(3, clip_high_threshold=per_token)], **kw
    )
    got = batch["clip_high_threshold"]
    assert got[0].tolist() == pytest.approx([1.05] * 4)
    assert got[1, :3].tolist() == pytest.approx([1.1, 1.2, 5.0])
    with pytest.raises(ServiceError, match=r"datum 1: loss_fn_inputs\['clip_high_threshold'\] is"):
        to_tensors([_datum(4, clip_high_threshold=one), _datum(3)], **kw)
    with pytest.raises(ServiceError, match=r"one value \(\[1\]\) or one per token \(\[4\]\)"):
        to_tensors([_datum(4, clip_high_threshold=np.ones(2, np.float32))], **kw)
    # the loss uses them: a ratio above every bound is clipped to the datum's own
    logp = torch.zeros(2, 4, dtype=torch.float32)
    batch["old_log_probs"] = torch.full((2, 4), -1.0)  # r = e
    batch["advantages"] = torch.ones(2, 4)
    batch["loss_mask"] = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])
    total = forward_loss("tinker_ppo", logp, batch, {"clip_high_threshold": 9.0})
    assert total == pytest.approx(-(1.05 + 1.2), rel=1e-6)
