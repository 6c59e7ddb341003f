"""The loss registry and the built-in losses, against hand-computed values (pure, fast)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tgruntime.trainer import losses
from tgruntime.trainer.loss_catalog import resolve_loss
from tgruntime.trainer.losses import MissingTensorError, TokenTensors
from tgruntime.trainer.token_batch import split_token_batch, token_batch


def _t(**tensors: torch.Tensor) -> TokenTensors:
    return TokenTensors(tensors, loss="test")


def test_cross_entropy_is_minus_log_prob() -> None:
    logp = torch.tensor([[-0.5, -2.0]])
    per_token, metrics = losses.cross_entropy(logp, _t(), {})
    assert per_token.tolist() == [[0.5, 2.0]] and metrics == {}


def test_importance_sampling_by_hand() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    old = torch.tensor([[math.log(0.25), math.log(0.2)]])
    adv = torch.tensor([[1.0, -3.0]])
    per_token, metrics = losses.importance_sampling(
        logp, _t(old_log_probs=old, advantages=adv), {}
    )
    # ratios 2 and 1: -(2 * 1), -(1 * -3)
    assert per_token[0].tolist() == pytest.approx([-2.0, 3.0])
    assert metrics["ratio"][0].tolist() == pytest.approx([2.0, 1.0])


def test_ppo_clips_both_sides_and_adds_kl() -> None:
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    logp = torch.zeros(1, 4)
    old = -torch.log(ratios)  # exp(logp - old) = ratios
    batch = _t(old_log_probs=old, advantages=adv, ref_log_probs=torch.zeros(1, 4))
    per_token, metrics = losses.ppo(logp, batch, {"clip_eps": 0.2, "clip_eps_high": 0.3})
    # 1.5, A>0: clipped to 1.3 -> -1.3; 0.5, A<0: max(0.5, 0.8) -> 0.8 (clipped);
    # 1.1 inside: -1.1; 0.5, A>0: max(-0.5, -0.8) = -0.5 (unclipped: pessimistic side)
    assert per_token[0].tolist() == pytest.approx([-1.3, 0.8, -1.1, -0.5])
    assert metrics["clip_frac"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert "kl" not in metrics  # kl_coef defaults to 0
    ref = torch.tensor([[math.log(2.0), 0.0, 0.0, 0.0]])
    batch = _t(old_log_probs=old, advantages=adv, ref_log_probs=ref)
    with_kl, metrics = losses.ppo(logp, batch, {"kl_coef": 0.5})
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(d) - d - 1 with d = ref - logp = log 2
    assert metrics["kl"][0, 0].item() == pytest.approx(k3)
    base, _ = losses.ppo(logp, batch, {})
    assert (with_kl - base)[0].tolist() == pytest.approx([0.5 * k3, 0.0, 0.0, 0.0])
    k1, _ = losses.ppo(logp, batch, {"kl_coef": 1.0, "kl_estimator": "k1"})
    assert (k1 - base)[0, 0].item() == pytest.approx(-math.log(2.0))


def test_ppo_gradient_is_zero_where_clipped() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.tensor([[-math.log(1.5), 0.0]])  # ratio 1.5 (clipped for A>0), 1.0
    per_token, _ = losses.ppo(logp, _t(old_log_probs=old, advantages=torch.ones(1, 2)), {})
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    assert grad[0].tolist() == pytest.approx([0.0, -1.0])


def test_bad_names_and_missing_tensors_say_the_fix() -> None:
    with pytest.raises(ValueError, match=r"unknown loss 'pp0'.*registered: .*'ppo'.*register_loss"):
        resolve_loss("pp0")
    with pytest.raises(ValueError, match="cannot import 'nope' from module 'math'"):
        resolve_loss("math:nope")
    spec = resolve_loss("ppo")
    with pytest.raises(MissingTensorError, match=r"batch\['advantages'\].*DataProto.from_dict"):
        spec.check(["loss_mask", "old_log_probs"])
    with pytest.raises(MissingTensorError, match=r"loss 'test' needs batch\['ref_log_probs'\]"):
        losses.ppo(
            torch.zeros(1, 1),
            _t(old_log_probs=torch.zeros(1, 1), advantages=torch.zeros(1, 1)),
            {"kl_coef": 0.1},
        )
    with pytest.raises(ValueError, match=r"loss_config\['clip_eps'\] must be a number"):
        losses.ppo(torch.zeros(1, 1), _t(), {"clip_eps": "0.2"})


def test_register_and_resolve_user_losses() -> None:
    def scaled(logp: torch.Tensor, batch: TokenTensors, config: Any) -> Any:
        return -logp * float(config.get("scale", 1.0)), {}

    losses.register_loss("test-scaled", scaled, required=("weights_x",))
    try:
        assert "test-scaled" in losses.registered_losses()
        assert resolve_loss("test-scaled").required == ("weights_x",)
        with pytest.raises(ValueError, match="already registered"):
            losses.register_loss("test-scaled", scaled)
    finally:
        losses._REGISTRY.pop("test-scaled")
    assert resolve_loss(scaled).fn is scaled  # a callable is used as is
    imported = resolve_loss("tgruntime.trainer.losses:cross_entropy")
    assert imported.fn is losses.cross_entropy
    spec = resolve_loss(lambda lp, b, c: (lp.sum(), {}))
    with pytest.raises(ValueError, match=r"per-token loss of shape \(\).*unreduced"):
        losses.check_loss_output(spec, spec.fn(torch.zeros(2, 3), _t(), {}), (2, 3))


def test_token_batch_alignment_and_masks() -> None:
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    b = token_batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "loss_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]),  # [B, S]: column 0 dropped
            "advantages": torch.ones(2, 3),
            "reward": torch.tensor([1.0, 0.0]),
        },
        device=torch.device("cpu"),
        vocab_size=16,
    )
    assert b.labels.tolist() == [[2, 3, 4, 0], [6, 7, 8, 0]]
    assert b.valid.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.weights.tolist() == [[1, 1, 0], [1, 1, 0]]
    assert set(b.extras) == {"advantages", "reward"}
    assert [m.batch_size for m in split_token_batch(b, 1)] == [1, 1]
    with pytest.raises(ValueError, match="right-padded"):
        token_batch(
            {"input_ids": ids, "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])},
            device=torch.device("cpu"),
            vocab_size=16,
        )
    with pytest.raises(ValueError, match=r"batch\['advantages'\] has shape \(2, 2\)"):
        token_batch(
            {"input_ids": ids, "advantages": torch.ones(2, 2)},
            device=torch.device("cpu"),
            vocab_size=16,
        )
    with pytest.raises(ValueError, match=r"needs batch\['input_ids'\]"):
        token_batch({}, device=torch.device("cpu"), vocab_size=16)
