"""Tinker's built-in losses, as Tinker defines them (tinker 0.38.0 docs, "Loss functions").

Each is a pure ``fn(log_probs, batch, config) -> (per_token_loss, metrics)`` (the contract of
:mod:`tgruntime.trainer.losses`). The trainer multiplies the per-token loss by ``loss_mask``
(Tinker's ``weights``; 1 on every real token when not sent) and, with
``forward_backward(..., reduction="sum")``, sums it: Tinker's losses are sums over tokens.

Notation: ``logp`` = the learner's log-prob of the target token, ``q`` = the sampler's
log-prob (``old_log_probs``, Tinker's ``logprobs`` input), ``A`` = ``advantages``,
``r = exp(logp - q)``, ``sg`` = stop-gradient.

=====================  ========================================================  ===========
Tinker name            per-token loss                                            config
=====================  ========================================================  ===========
cross_entropy          ``-logp``                                                 -
importance_sampling    ``-r * A``                                                -
ppo                    ``-min(r * A, clip(r, lo, hi) * A)``                      lo, hi
cispo                  ``-sg(clip(r, lo, hi)) * logp * A``                       lo, hi
dro                    ``-(logp * A - beta / 2 * (logp - q) ** 2)``              beta
gspo                   ``-min(s_t * A, clip(s_t, lo, hi) * A)``                  lo, hi
=====================  ========================================================  ===========

``gspo`` (GSPO-token, Tinker's "GSPO" page): one importance ratio per sequence, the geometric
mean of the token ratios over the positions ``sequence_ratio_mask`` marks (non-zero),
``s = exp(mean_M(logp - q))``; every token carries ``s``'s value with its own log-prob's
gradient, ``s_t = sg(s) * exp(logp - sg(logp))``, then PPO's clipped objective per token. A
row whose mask marks nothing has ``s = 1``. One row is one datum (the trainer never splits a
row across micro-batches), so the mean is over the whole sequence.

``stable_reinforce`` (Tinker's StableReinforce, alpha) is a REINFORCE whose importance weight
comes from what the server recorded at sampling time (:mod:`tgruntime.service.stability`), not
from the datum: ``q`` = the recorded sampler log-prob of each target a sampled provenance run
names (``stability_log_probs``; ``stability_mask`` marks those targets). With
``log_r = clamp(logp - q, -20, 20)`` on marked targets (0 elsewhere) and ``r = exp(log_r)``::

    loss_t = -sg(min(r, c)) * A * logp  +  kl_coeff * (r - 1 - log_r)

a truncated importance weight (``c`` = ``loss_config["max_ratio"]``, default 1: a token the
learner already favours more than the sampler did is not pushed harder; one it disfavours
fades out) times the REINFORCE term, plus an optional penalty (``kl_coeff``, default 0: the
k3 estimate of KL(sampler || learner), zero on-policy). On-policy (``r = 1``) its gradient is
``importance_sampling``'s. This is our reading of Tinker's page (the formula there could not
be read when this was written): docs/tinker.md says so in its differences table.

``lo``/``hi`` are ``loss_config["clip_low_threshold"]`` / ``["clip_high_threshold"]``: bounds
on the ratio itself (defaults 0.8 and 1.2: Tinker's epsilon 0.2), or per-token / per-sample
tensors of the same names in the batch (Tinker's ``loss_fn_inputs`` may carry them).
``beta`` has no documented default: it is required.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tgruntime.trainer.losses import Metrics, TokenTensors, register_loss

__all__ = [
    "TINKER_INPUTS",
    "TINKER_LOSSES",
    "UNSUPPORTED",
    "tinker_cispo",
    "tinker_cross_entropy",
    "tinker_dro",
    "tinker_gspo",
    "tinker_importance_sampling",
    "tinker_loss_name",
    "tinker_ppo",
    "tinker_stable_reinforce",
]

# Tinker's loss name -> the registered loss.
TINKER_LOSSES: dict[str, str] = {
    "cross_entropy": "tinker_cross_entropy",
    "importance_sampling": "tinker_importance_sampling",
    "ppo": "tinker_ppo",
    "cispo": "tinker_cispo",
    "dro": "tinker_dro",
    "gspo": "tinker_gspo",
    "stable_reinforce": "tinker_stable_reinforce",
}
# Datum.loss_fn_inputs key -> DataProto key (model_input -> input_ids).
TINKER_INPUTS: dict[str, str] = {
    "target_tokens": "target_ids",
    "weights": "loss_mask",
    "logprobs": "old_log_probs",
    "advantages": "advantages",
    "clip_low_threshold": "clip_low_threshold",
    "clip_high_threshold": "clip_high_threshold",
    "sequence_ratio_mask": "sequence_ratio_mask",
}
UNSUPPORTED: dict[str, str] = {
    "custom": "forward_backward_custom is built on forward + cross_entropy: use those",
}


def tinker_loss_name(name: str) -> str:
    """The registered loss for Tinker's ``name``; a clear ``ValueError`` otherwise."""
    if name in TINKER_LOSSES:
        return TINKER_LOSSES[name]
    why = UNSUPPORTED.get(name, "unknown loss")
    raise ValueError(
        f"loss_fn {name!r} is not supported ({why}); supported: {sorted(TINKER_LOSSES)}"
    )


def _ratio(log_probs: torch.Tensor, batch: TokenTensors) -> torch.Tensor:
    return torch.exp(log_probs - batch["old_log_probs"].to(log_probs.dtype))


def _bound(
    batch: TokenTensors, config: Mapping[str, Any], key: str, default: float, like: torch.Tensor
) -> torch.Tensor | float:
    if key in batch:
        value = batch[key].to(like.dtype)
        return value.unsqueeze(1) if value.dim() == 1 else value
    raw = config.get(key, default)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"loss_config[{key!r}] must be a number, got {raw!r}")
    return float(raw)


def _clipped(ratio: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]) -> torch.Tensor:
    lo = _bound(batch, config, "clip_low_threshold", 0.8, ratio)
    hi = _bound(batch, config, "clip_high_threshold", 1.2, ratio)
    if isinstance(lo, float) and isinstance(hi, float) and lo > hi:
        raise ValueError(f"clip_low_threshold {lo} > clip_high_threshold {hi}")
    lo_t = torch.as_tensor(lo, dtype=ratio.dtype, device=ratio.device)
    hi_t = torch.as_tensor(hi, dtype=ratio.dtype, device=ratio.device)
    return torch.minimum(torch.maximum(ratio, lo_t), hi_t)


def tinker_cross_entropy(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """``-logp`` per token (``weights`` = ``loss_mask``, applied by the trainer)."""
    return -log_probs, {}


def tinker_importance_sampling(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """``-exp(logp - q) * A`` per token."""
    ratio = _ratio(log_probs, batch)
    return -ratio * batch["advantages"].to(log_probs.dtype), {"ratio": ratio.detach()}


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """PPO's pessimistic clipped objective, negated, with its ratio and clip-fraction metrics
    (ppo's ratio is per token, gspo's per sequence)."""
    unclipped = ratio * adv
    clipped = _clipped(ratio, batch, config) * adv
    objective = torch.minimum(unclipped, clipped)
    return -objective, {
        "ratio": ratio.detach(),
        "clip_frac": (clipped < unclipped).to(ratio.dtype).detach(),
    }


def tinker_ppo(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """``-min(r * A, clip(r, lo, hi) * A)`` per token."""
    adv = batch["advantages"].to(log_probs.dtype)
    ratio = _ratio(log_probs, batch)
    return _clipped_objective(ratio, adv, batch, config)


def tinker_cispo(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """``-sg(clip(r, lo, hi)) * logp * A`` per token."""
    adv = batch["advantages"].to(log_probs.dtype)
    ratio = _ratio(log_probs, batch)
    weight = _clipped(ratio, batch, config).detach()
    return -weight * log_probs * adv, {
        "ratio": ratio.detach(),
        "clip_frac": (weight != ratio).to(log_probs.dtype).detach(),
    }


def tinker_dro(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """``-(logp * A - beta / 2 * (logp - q) ** 2)`` per token; ``beta`` is required."""
    beta = config.get("beta")
    if isinstance(beta, bool) or not isinstance(beta, int | float):
        raise ValueError(f"loss 'dro' needs loss_config['beta'] (a number), got {beta!r}")
    adv = batch["advantages"].to(log_probs.dtype)
    delta = log_probs - batch["old_log_probs"].to(log_probs.dtype)
    return -(log_probs * adv - 0.5 * float(beta) * delta * delta), {}


def tinker_gspo(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token: ``-min(s_t * A, clip(s_t, lo, hi) * A)`` per token, ``s_t`` the sequence's
    ratio ``exp(mean over sequence_ratio_mask of (logp - q))`` with each token's own gradient."""
    adv = batch["advantages"].to(log_probs.dtype)
    q = batch["old_log_probs"].to(log_probs.dtype)
    marked = batch["sequence_ratio_mask"] != 0
    if marked.shape != log_probs.shape:
        raise ValueError(
            f"sequence_ratio_mask must be per token {list(log_probs.shape)}, got "
            f"{list(marked.shape)}"
        )
    token_log_ratio = torch.where(marked, log_probs.detach() - q, torch.zeros_like(q))
    count = marked.sum(dim=1, keepdim=True).clamp(min=1).to(log_probs.dtype)
    seq_log_ratio = token_log_ratio.sum(dim=1, keepdim=True) / count  # [b, 1]; 0 if none marked
    ratio = torch.exp(seq_log_ratio + (log_probs - log_probs.detach()))
    return _clipped_objective(ratio, adv, batch, config)


def _number(config: Mapping[str, Any], key: str, default: float, *, positive: bool) -> float:
    raw = config.get(key, default)
    ok = isinstance(raw, int | float) and not isinstance(raw, bool)
    if not ok or not (raw > 0 if positive else raw >= 0):
        what = "> 0" if positive else ">= 0"
        raise ValueError(f"loss_config[{key!r}] must be a number {what}, got {raw!r}")
    return float(raw)


MAX_LOG_RATIO = 20.0  # |logp - q| beyond this is clamped: exp stays finite


def tinker_stable_reinforce(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """``-sg(min(r, c)) * A * logp + kl_coeff * (r - 1 - log r)`` per token, ``r`` against
    the sampler's recorded log-probs on the targets ``stability_mask`` marks (module doc)."""
    cap = _number(config, "max_ratio", 1.0, positive=True)
    kl_coeff = _number(config, "kl_coeff", 0.0, positive=False)
    adv = batch["advantages"].to(log_probs.dtype)
    q = batch["stability_log_probs"].to(log_probs.dtype)
    marked = batch["stability_mask"] != 0
    delta = (log_probs - q).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    log_ratio = torch.where(marked, delta, torch.zeros_like(delta))
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio.detach(), max=cap)
    per_token = -weight * adv * log_probs
    k3 = ratio - 1.0 - log_ratio
    if kl_coeff:
        per_token = per_token + kl_coeff * k3
    return per_token, {
        "ratio": ratio.detach(),
        "clip_frac": (marked & (ratio.detach() > cap)).to(log_probs.dtype),
        "kl": k3.detach(),
    }


_NEEDS = ("advantages", "old_log_probs")
register_loss("tinker_cross_entropy", tinker_cross_entropy)
register_loss("tinker_importance_sampling", tinker_importance_sampling, required=_NEEDS)
register_loss("tinker_ppo", tinker_ppo, required=_NEEDS)
register_loss("tinker_cispo", tinker_cispo, required=_NEEDS)
register_loss("tinker_dro", tinker_dro, required=_NEEDS)
register_loss("tinker_gspo", tinker_gspo, required=(*_NEEDS, "sequence_ratio_mask"))
register_loss(
    "tinker_stable_reinforce",
    tinker_stable_reinforce,
    required=("advantages", "stability_log_probs", "stability_mask"),
)
