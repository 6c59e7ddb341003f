"""Tinker's semantics in the trainer: losses, sum reduction, explicit targets, AdamParams.

Pure-function tests (no megatron): each of Tinker's losses against a float64 value computed
by hand, explicit ``target_ids`` alignment and validation, the name mapping.

One launch of two processes (TP=2, CPU, gloo, fp32) for the rest: for every loss, the
summed ``forward_backward`` loss against a float64 reference computed with transformers'
``LlamaForCausalLM`` on the exported weights (rtol 1e-5, atol 1e-4 on sums of ~100 tokens),
per-token log-probs against it (atol 2e-5), two calls then one call on the concatenation
give the same gradient (atol 1e-6); two ``optim_step``s with per-step betas/eps/lr and no
clipping against torch's AdamW on copies of the weights; ``load_checkpoint(optimizer=False)``.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures_ray import RayCluster
from tgruntime.trainer.loss_catalog import resolve_loss
from tgruntime.trainer.losses import TokenTensors
from tgruntime.trainer.tinker_losses import TINKER_LOSSES, tinker_loss_name
from tgruntime.trainer.token_batch import token_batch

pytestmark = pytest.mark.megatron


def _batch(**tensors: torch.Tensor) -> TokenTensors:
    return TokenTensors(tensors, loss="test")


# -- pure functions, one token at a time, by hand --------------------------------------------
LOGP, Q, ADV = -1.0, -1.5, 2.0  # r = exp(0.5) = 1.6487...


def _one(name: str, config: dict[str, Any], *, logp: float = LOGP, adv: float = ADV) -> float:
    lp = torch.tensor([[logp]], dtype=torch.float64)
    batch = _batch(
        old_log_probs=torch.tensor([[Q]], dtype=torch.float64),
        advantages=torch.tensor([[adv]], dtype=torch.float64),
    )
    per_token, _ = resolve_loss(TINKER_LOSSES[name]).fn(lp, batch, config)
    return float(per_token)


def test_cross_entropy_by_hand() -> None:
    assert _one("cross_entropy", {}) == 1.0


def test_importance_sampling_by_hand() -> None:
    assert _one("importance_sampling", {}) == pytest.approx(-math.exp(0.5) * ADV, abs=1e-15)


def test_ppo_by_hand() -> None:
    r = math.exp(0.5)
    # A > 0, r above hi: min(r A, hi A) = hi A
    assert _one("ppo", {}) == pytest.approx(-1.2 * ADV, abs=1e-15)
    assert _one("ppo", {"clip_high_threshold": 2.0}) == pytest.approx(-r * ADV, abs=1e-15)
    # A < 0: min(r A, clip(r) A) = r A (the unclipped, more pessimistic one)
    assert _one("ppo", {}, adv=-1.0) == pytest.approx(r, abs=1e-15)
    # r below lo with A < 0: min picks lo * A
    assert _one("ppo", {}, logp=-2.0, adv=-1.0) == pytest.approx(0.8, abs=1e-15)


def test_cispo_by_hand_and_its_gradient_is_stopped_through_the_ratio() -> None:
    assert _one("cispo", {}) == pytest.approx(-1.2 * LOGP * ADV, abs=1e-15)
    lp = torch.tensor([[LOGP]], dtype=torch.float64, requires_grad=True)
    batch = _batch(
        old_log_probs=torch.tensor([[Q]], dtype=torch.float64),
        advantages=torch.tensor([[ADV]], dtype=torch.float64),
    )
    per_token, _ = resolve_loss("tinker_cispo").fn(lp, batch, {"clip_high_threshold": 5.0})
    (grad,) = torch.autograd.grad(per_token.sum(), lp)
    assert float(grad) == pytest.approx(-math.exp(0.5) * ADV, abs=1e-15)  # sg(r) * A


def test_dro_by_hand_and_beta_is_required() -> None:
    expected = -(LOGP * ADV - 0.5 * 0.1 * 0.5**2)
    assert _one("dro", {"beta": 0.1}) == pytest.approx(expected, abs=1e-15)
    with pytest.raises(ValueError, match=r"needs loss_config\['beta'\]"):
        _one("dro", {})


def test_per_token_thresholds_from_the_batch() -> None:
    lp = torch.tensor([[LOGP, LOGP]], dtype=torch.float64)
    batch = _batch(
        old_log_probs=torch.full((1, 2), Q, dtype=torch.float64),
        advantages=torch.full((1, 2), ADV, dtype=torch.float64),
        clip_high_threshold=torch.tensor([[1.1, 3.0]], dtype=torch.float64),
    )
    per_token, _ = resolve_loss("tinker_ppo").fn(lp, batch, {})
    assert per_token.tolist()[0] == pytest.approx([-1.1 * ADV, -math.exp(0.5) * ADV])


def test_names_map_one_to_one_and_unsupported_ones_are_refused() -> None:
    assert set(TINKER_LOSSES) == {
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
        "stable_reinforce",
    }
    for name in TINKER_LOSSES:
        assert resolve_loss(tinker_loss_name(name)).name == f"tinker_{name}"
    for name in ("custom", "nope"):
        with pytest.raises(ValueError, match="not supported"):
            tinker_loss_name(name)


# -- explicit targets ----------------------------------------------------------------------
def test_explicit_targets_are_not_shifted() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    targets = torch.tensor([[7, 8, 9], [0, 1, 2]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    b = token_batch(
        {
            "input_ids": ids,
            "target_ids": targets,
            "attention_mask": mask,
            "advantages": torch.ones(2, 3),
            "loss_mask": torch.full((2, 3), 0.5),
        },
        device=torch.device("cpu"),
        vocab_size=10,
    )
    assert b.labels.tolist() == targets.tolist()
    assert b.num_targets == 3
    assert b.valid.tolist() == mask.float().tolist()
    assert b.weights.tolist() == (0.5 * mask.float()).tolist()
    assert tuple(b.extras["advantages"].shape) == (2, 3)
    assert "target_ids" not in b.extras
    with pytest.raises(ValueError, match=r"with target_ids a per-token tensor must be \[B, S\]"):
        token_batch(
            {"input_ids": ids, "target_ids": targets, "advantages": torch.ones(2, 2)},
            device=torch.device("cpu"),
            vocab_size=10,
        )


@pytest.mark.parametrize("bad", [10, -1])
def test_target_ids_outside_the_vocabulary_are_named(bad: int) -> None:
    ids = torch.zeros(1, 3, dtype=torch.int64)
    targets = torch.tensor([[1, bad, 2]])
    with pytest.raises(ValueError, match=r"target_ids must lie in \[0, 10\).*vocab_size is 10"):
        token_batch(
            {"input_ids": ids, "target_ids": targets}, device=torch.device("cpu"), vocab_size=10
        )
    with pytest.raises(ValueError, match=r"target_ids must be \[B, S\]"):
        token_batch(
            {"input_ids": ids, "target_ids": targets[:, :2]},
            device=torch.device("cpu"),
            vocab_size=10,
        )


# -- TP=2 engine against transformers in float64 --------------------------------------------
@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core")
    from tests.trainer import tinker_scenarios
    from tgruntime.trainer.launch import launch

    root = tmp_path_factory.mktemp("tinker")
    blobs = launch(
        tinker_scenarios.tinker_suite,
        world_size=2,
        kwargs={"hf_dir": str(root / "hf"), "ckpt_dir": str(root / "ckpt")},
        timeout_s=600,
    )
    ranks = [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]
    return {"ranks": ranks, "hf_dir": root / "hf"}


def _reference_log_probs(hf_dir: Path, t: dict[str, torch.Tensor]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    logp = torch.log_softmax(logits.double(), dim=-1)
    picked = logp.gather(-1, t["target_ids"].unsqueeze(-1)).squeeze(-1)
    return picked * t["attention_mask"].double()


def _reference_loss(name: str, logp: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tinker's formulas written out again, in float64, per token."""
    from tests.trainer.tinker_scenarios import LOSSES

    config = LOSSES[name]
    q = t["old_log_probs"].double()
    adv = t["advantages"].double()
    ratio = torch.exp(logp - q)
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if name == "cross_entropy":
        per_token = -logp
    elif name == "importance_sampling":
        per_token = -ratio * adv
    elif name == "ppo":
        per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    elif name == "cispo":
        per_token = -ratio.clamp(lo, hi) * logp * adv
    elif name == "gspo":  # one ratio per datum: exp(mean log-ratio over the marked tokens)
        marked = t["sequence_ratio_mask"].double() != 0
        mean = ((logp - q) * marked).sum(1, keepdim=True) / marked.sum(1, keepdim=True)
        s = torch.exp(mean).expand_as(logp)
        per_token = -torch.minimum(s * adv, s.clamp(lo, hi) * adv)
    else:
        per_token = -(logp * adv - 0.5 * config["beta"] * (logp - q) ** 2)
    return per_token * t["loss_mask"].double() * t["attention_mask"].double()


@pytest.mark.parametrize(
    "name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]
)
def test_summed_loss_and_accumulation_under_tp2(suite: dict[str, Any], name: str) -> None:
    ranks = suite["ranks"]
    t = ranks[0]["inputs"]
    expected_logp = _reference_log_probs(suite["hf_dir"], t)
    torch.testing.assert_close(ranks[0]["log_probs"].double(), expected_logp, atol=2e-5, rtol=0)
    per_token = _reference_loss(name, expected_logp, t)
    for rank in ranks:
        got = rank["losses"][name]
        assert got["loss"] == pytest.approx(float(per_token.sum()), rel=1e-5, abs=1e-4)
        assert list(got["per_sample"]) == pytest.approx(
            per_token.sum(1).tolist(), rel=1e-5, abs=1e-4
        )
        assert sum(got["halves"]) == pytest.approx(got["loss"], rel=1e-6, abs=1e-5)
        torch.testing.assert_close(got["log_probs"].double(), expected_logp, atol=2e-5, rtol=0)
        whole, split = got["grads_whole"]["tensors"], got["grads_split"]["tensors"]
        assert whole.keys() == split.keys()
        for key, (g, _dim) in whole.items():
            torch.testing.assert_close(split[key][0], g, atol=1e-6, rtol=1e-5, msg=key)
        assert any(float(g.abs().max()) > 0 for g, _ in whole.values())


def test_adam_params_per_step_and_weights_only_load(suite: dict[str, Any]) -> None:
    from tests.trainer.scenarios import tiny_spec

    spec = tiny_spec()
    for rank in suite["ranks"]:
        adam = rank["adam"]
        assert adam["adam_max_diff"] < 1e-6, adam  # betas, eps, lr, no clip: torch's AdamW
        for lr, betas, eps in adam["groups_after"]:  # the spec's values are back
            assert lr == pytest.approx(spec.optimizer.lr)
            assert tuple(betas) == (spec.optimizer.adam_beta1, spec.optimizer.adam_beta2)
            assert eps == 1e-8
        assert "reduction='sum'" in adam["mixed_error"]
        assert adam["moved"] > 0 and adam["restored_diff"] == 0.0
        assert adam["state_after_weights_only"] == 0
        assert adam["state_after_full"] > 0


# -- the same through TrainerClient and a real Ray group (what the Tinker server calls) ------
@pytest.mark.ray
def test_trainer_client_tinker_calls(ray_driver: RayCluster, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    from tests.trainer.groups import trainer_group
    from tests.trainer.scenarios import VOCAB, tiny_spec
    from tests.trainer.tinker_scenarios import MODEL, tinker_inputs
    from tgruntime import TrainerClient
    from tgruntime.controller.errors import WorkerMethodError

    wait = 180.0

    def batch_of(proto: Any) -> Any:
        assert proto.batch is not None
        return proto.batch

    spec = tiny_spec(tp=2, **MODEL)  # type: ignore[arg-type]
    wg = trainer_group(spec, prefix="tinker")
    try:
        wg.init_model()
        client = TrainerClient(wg)
        raw = tinker_inputs()
        data = {k: raw[k] for k in ("input_ids", "target_ids", "attention_mask")}
        lp = batch_of(client.compute_log_prob(data).result(timeout=wait))["log_probs"]
        assert tuple(lp.shape) == tuple(raw["input_ids"].shape)
        batch = {
            **data,
            "advantages": raw["advantages"],
            "old_log_probs": (lp + raw["noise"]) * raw["attention_mask"],
        }
        bad = {
            **batch,
            "target_ids": torch.where(
                raw["target_ids"] > 3, raw["target_ids"], torch.full_like(raw["target_ids"], VOCAB)
            ),
        }
        with pytest.raises(ValueError, match=rf"target_ids must lie in \[0, {VOCAB}\)"):
            client.forward_backward(bad, loss="tinker_ppo", reduction="sum")  # before sending
        fb = client.forward_backward(
            batch,
            loss=tinker_loss_name("ppo"),
            reduction="sum",
            loss_config={"clip_low_threshold": 0.9},
        )
        out = fb.result(timeout=wait)
        torch.testing.assert_close(batch_of(out)["log_probs"], lp, atol=1e-6, rtol=0)
        assert out.meta_info["reduction"] == "sum"
        assert out.meta_info["loss"] == pytest.approx(float(batch_of(out)["loss"].sum()), rel=1e-5)
        with pytest.raises(WorkerMethodError, match="cannot be mixed"):
            client.forward_backward(batch, loss="tinker_importance_sampling").result(timeout=wait)
        step = client.optim_step(
            lr=1e-3, betas=(0.8, 0.9), eps=1e-10, weight_decay=0.01, grad_clip=0.0
        ).result(timeout=wait)
        assert step["step"] == 1 and step["lr"] == pytest.approx(1e-3)
        path = client.save_state(str(tmp_path / "state")).result(timeout=wait)
        client.forward_backward(batch, loss="tinker_cross_entropy", reduction="sum")
        client.optim_step(lr=1e-2, grad_clip=0.0).result(timeout=wait)
        assert client.load_state(path, optimizer=False).result(timeout=wait) == 1
        after = batch_of(client.compute_log_prob(data).result(timeout=wait))["log_probs"]
        fb2 = client.forward_backward(batch, loss="tinker_ppo", reduction="sum").result(
            timeout=wait
        )
        torch.testing.assert_close(batch_of(fb2)["log_probs"], after, atol=1e-6, rtol=0)
        assert client.load_state(path).result(timeout=wait) == 1
    finally:
        wg.teardown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
def test_gpu_sum_reduction_adam_params_and_weights_only_load(tmp_path: Path) -> None:
    from tests.trainer import tinker_scenarios
    from tgruntime.trainer.launch import launch

    (run,) = launch(
        tinker_scenarios.tinker_gpu_suite,
        world_size=1,
        kwargs={"ckpt_dir": str(tmp_path / "ckpt")},
        timeout_s=300,
    )
    print(run)
    assert math.isfinite(run["loss"]) and run["grad_norm"] > 0
    assert run["grad_rel_diff"] < 1e-2, run  # bf16 model, fp32 gradient buffers
    for _lr, betas, eps in run["groups_after"]:
        assert tuple(betas) == (0.9, 0.95) and eps == 1e-8
    assert run["moved"] > 0
    assert run["kept_after_weights_only"] == 0.0, run  # main params re-copied from the load
