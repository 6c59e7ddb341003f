"""``stable_reinforce``'s loss against a float64 reference written from docs/tinker.md.

Pure torch, no Ray, no megatron. The reference works token by token in Python floats: on a
target a sampled provenance run names (``stability_mask``), ``d = clamp(logp - q, -20, 20)``,
``r = e^d``, loss ``-min(r, c) * A * logp + k * (r - 1 - d)`` and its derivative in ``logp``
``-min(r, c) * A + k * (r - 1)`` (0 for the penalty where the clamp holds); elsewhere
``-A * logp``, derivative ``-A``. Rows mix on- and off-policy tokens, one beyond the clamp.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tgruntime.trainer.loss_catalog import resolve_loss
from tgruntime.trainer.losses import TokenTensors
from tgruntime.trainer.tinker_losses import TINKER_LOSSES, UNSUPPORTED, tinker_loss_name

F64 = torch.float64
CONFIGS: list[dict[str, Any]] = [{}, {"max_ratio": 1.5, "kl_coeff": 0.1}, {"kl_coeff": 2.0}]


def _inputs(seed: int = 0, b: int = 3, t: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 3 - 0.1
    q = logp + (torch.rand(b, t, generator=g, dtype=F64) - 0.5) * 1.6
    q[0, 3] = logp[0, 3]  # on-policy: r = 1
    q[1, 5] = logp[1, 5] + 30.0  # far off-policy: beyond the clamp (r = e^-20)
    adv = torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.zeros(b, t, dtype=F64)
    mask[0, 2:] = 1.0
    mask[1, 1:] = 1.0
    mask[2, :] = 1.0
    return {"logp": logp, "stability_log_probs": q, "advantages": adv, "stability_mask": mask}


def _reference(x: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[list[list[float]],
                                                                            list[list[float]]]:
    """Per-token loss and d(loss)/d(logp), by hand."""
    cap, k = float(config.get("max_ratio", 1.0)), float(config.get("kl_coeff", 0.0))
    logp, q = x["logp"].tolist(), x["stability_log_probs"].tolist()
    adv, mask = x["advantages"].tolist(), x["stability_mask"].tolist()
    losses, grads = [], []
    for i in range(len(logp)):
        row_l, row_g = [], []
        for j in range(len(logp[i])):
            lp, a = logp[i][j], adv[i][j]
            if mask[i][j] == 0:
                row_l.append(-a * lp)
                row_g.append(-a)
                continue
            raw = lp - q[i][j]
            d = min(max(raw, -20.0), 20.0)
            r = math.exp(d)
            w = min(r, cap)
            row_l.append(-w * a * lp + k * (r - 1.0 - d))
            row_g.append(-w * a + (k * (r - 1.0) if abs(raw) < 20.0 else 0.0))
        losses.append(row_l)
        grads.append(row_g)
    return losses, grads


@pytest.mark.parametrize("config", CONFIGS)
def test_stable_reinforce_loss_and_gradient_against_the_float64_reference(
    config: dict[str, Any],
) -> None:
    x = _inputs(1)
    want_loss, want_grad = _reference(x, config)
    lp = x["logp"].clone().requires_grad_(True)
    batch = TokenTensors({k: v for k, v in x.items() if k != "logp"}, loss="t")
    fn = resolve_loss(tinker_loss_name("stable_reinforce")).fn
    per_token, metrics = fn(lp, batch, config)
    torch.testing.assert_close(per_token.detach(), torch.tensor(want_loss, dtype=F64),
                               atol=1e-12, rtol=1e-12)
    (grad,) = torch.autograd.grad(per_token.sum(), lp)
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), atol=1e-12, rtol=1e-12)
    assert metrics["ratio"][0, 3] == 1.0 and metrics["ratio"][0, 0] == 1.0  # on-policy, unmarked
    assert math.isfinite(float(metrics["kl"].sum()))


def test_on_policy_its_gradient_is_importance_samplings() -> None:
    x = _inputs(2)
    x["stability_log_probs"] = x["logp"].clone()
    lp = x["logp"].clone().requires_grad_(True)
    tensors = {k: v for k, v in x.items() if k != "logp"}
    sr = resolve_loss("tinker_stable_reinforce").fn(lp, TokenTensors(tensors, loss="s"), {})[0]
    (g_sr,) = torch.autograd.grad(sr.sum(), lp)
    tensors["old_log_probs"] = x["stability_log_probs"]
    lp2 = x["logp"].clone().requires_grad_(True)
    imp = resolve_loss("tinker_importance_sampling").fn(lp2, TokenTensors(tensors, loss="i"),
                                                       {})[0]
    (g_is,) = torch.autograd.grad(imp.sum(), lp2)
    torch.testing.assert_close(g_sr, g_is, atol=1e-12, rtol=1e-12)


def test_stable_reinforce_is_served_and_its_config_is_checked() -> None:
    assert TINKER_LOSSES["stable_reinforce"] == "tinker_stable_reinforce"
    assert "stable_reinforce" not in UNSUPPORTED
    spec = resolve_loss("tinker_stable_reinforce")
    assert set(spec.required) == {"advantages", "stability_log_probs", "stability_mask"}
    x = _inputs(3)
    batch = TokenTensors({k: v for k, v in x.items() if k != "logp"}, loss="t")
    for bad in ({"max_ratio": 0}, {"kl_coeff": -1.0}, {"kl_coeff": "x"}):
        with pytest.raises(ValueError, match="loss_config"):
            spec.fn(x["logp"], batch, bad)
