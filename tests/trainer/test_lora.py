"""LoRA on the megatron model against ``peft`` on ``LlamaForCausalLM`` (CPU, gloo, float32).

One launch of two processes runs three layouts (TP=2; PP=2; TP=1 with DP=2) on the same
tiny Llama that this test builds with transformers and saves (``save_pretrained``), with
the same initial adapter (peft's A, a non-zero B), written by peft and read by the
trainer. Checked against peft in float64: log-probs, the gradient of every adapter tensor
under summed cross-entropy and PPO, that a step moves only the adapters, that the
PEFT-format export loads in peft and the merged export in transformers with the
trainer's log-probs, and a per-rank save/load round trip.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.megatron

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.trainer import lora_scenarios  # noqa: E402
from tests.trainer.scenarios import tiny_spec  # noqa: E402
from tests.trainer.tinker_scenarios import tinker_inputs  # noqa: E402

LAYOUTS = list(lora_scenarios.LAYOUTS)


def _shape() -> Any:
    from tgruntime.trainer.hf_weights import LlamaShape

    spec = tiny_spec(**lora_scenarios.MODEL)
    return LlamaShape.from_model_spec(spec.model, position_embedding="rope")


def _write_base_and_init(root: Path) -> tuple[Path, Path]:
    """A random transformers Llama, and peft's adapter on it with B made non-zero."""
    config = transformers.LlamaConfig.from_dict(_shape().hf_config(dtype=torch.float32))
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config)
    base, init = root / "base", root / "init"
    model.save_pretrained(base)
    s = lora_scenarios.settings()
    lora_config = peft.LoraConfig(
        r=s.rank, lora_alpha=s.alpha, lora_dropout=0.0, target_modules=s.hf_targets()
    )
    wrapped = peft.get_peft_model(model, lora_config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    wrapped.save_pretrained(init, save_embedding_layers=False)
    return base, init


def _peft_model(base: Path, adapter: Path, *, trainable: bool = False) -> Any:
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    wrapped = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)
    return wrapped.double()


def _log_probs(model: Any, t: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
    logp = torch.log_softmax(logits.double(), dim=-1)
    picked = logp.gather(-1, t["target_ids"].unsqueeze(-1)).squeeze(-1)
    return picked * t["attention_mask"].double()


def _loss(name: str, logp: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    weights = t["loss_mask"].double() * t["attention_mask"].double()
    if name == "cross_entropy":
        return -(logp * weights).sum()
    ratio = torch.exp(logp - t["old_log_probs"].double())
    adv = t["advantages"].double()
    lo, hi = lora_scenarios.PPO["clip_low_threshold"], lora_scenarios.PPO["clip_high_threshold"]
    return -(torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv) * weights).sum()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tgruntime.trainer.launch import launch

    root = tmp_path_factory.mktemp("lora")
    base, init = _write_base_and_init(root)
    tensors = tinker_inputs()
    with torch.no_grad():
        initial = _log_probs(_peft_model(base, init), tensors)
    tensors["old_log_probs"] = (
        (initial + 0.3 * tensors.pop("noise")) * tensors["attention_mask"]
    ).float()
    blobs = launch(
        lora_scenarios.lora_suite,
        world_size=2,
        kwargs={
            "base_dir": str(base),
            "init_dir": str(init),
            "out_dir": str(root / "out"),
            "tensors": tensors,
        },
        timeout_s=300,
    )
    ranks = [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]
    reference: dict[str, Any] = {"log_probs": initial}
    for loss in ("cross_entropy", "ppo"):
        model = _peft_model(base, init, trainable=True)
        _loss(loss, _log_probs(model, tensors), tensors).backward()  # type: ignore[no-untyped-call]
        reference[loss] = {
            n.replace(".default", ""): p.grad.detach().clone()
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    return {"ranks": ranks, "tensors": tensors, "base": base, "reference": reference}


def _trainer_log_probs(run: dict[str, Any], layout: str, key: str) -> torch.Tensor:
    r0, r1 = (r[layout] for r in run["ranks"])
    if layout == "dp2":
        return torch.cat([r0[key], r1[key]]).double()
    if layout == "pp2":
        assert r0[key] is None  # only the last stage has them
        last: torch.Tensor = r1[key]
        return last.double()
    torch.testing.assert_close(r0[key], r1[key], rtol=0, atol=1e-6)
    first: torch.Tensor = r0[key]
    return first.double()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_log_probs_equal_peft(run: dict[str, Any], layout: str) -> None:
    got = _trainer_log_probs(run, layout, "log_probs")
    torch.testing.assert_close(got, run["reference"]["log_probs"], rtol=0, atol=2e-5)


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_gradients_equal_peft(run: dict[str, Any], layout: str, loss: str) -> None:
    got = run["ranks"][0][layout][loss]["grads"]
    want = run["reference"][loss]
    assert set(got) == set(want)
    assert len(got) == 2 * 2 * 7 + 2  # A and B of 7 projections in 2 layers, and lm_head
    for name, ref in want.items():
        scale = float(ref.abs().max())
        assert scale > 0, name  # B is non-zero, so A's gradient is too
        torch.testing.assert_close(
            got[name].double(), ref, rtol=1e-4, atol=1e-5 * max(scale, 1.0), msg=name
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_moves_only_the_adapters(run: dict[str, Any], layout: str) -> None:
    for rank in run["ranks"]:
        step = rank[layout]["step"]
        assert step["base_max_diff"] == 0.0
        assert not step["base_requires_grad"] and step["base_grads"] == 0
        assert step["optimizer_is_adapters"] and step["optimizer_params"] > 0
        assert step["optimizer_state_bytes"] == step["adam_bytes_adapters"]
        assert step["adam_bytes_adapters"] < step["adam_bytes_full"] / 4
    assert run["ranks"][0][layout]["step"]["adapter_moved"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_peft_export_loads_in_peft_with_the_same_log_probs(
    run: dict[str, Any], layout: str
) -> None:
    out = run["ranks"][0][layout]
    assert out["peft"]["tensors"] == 30
    with torch.no_grad():
        model = _peft_model(run["base"], Path(out["peft"]["path"]))
        want = _log_probs(model, run["tensors"])
    got = _trainer_log_probs(run, layout, "log_probs_after")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert (got - run["reference"]["log_probs"]).abs().max() > 1e-3  # the step changed them


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merged_export_loads_in_transformers_with_the_same_log_probs(
    run: dict[str, Any], layout: str
) -> None:
    out = run["ranks"][0][layout]
    model = transformers.LlamaForCausalLM.from_pretrained(out["merged"]["path"]).double()
    with torch.no_grad():
        want = _log_probs(model, run["tensors"])
    got = _trainer_log_probs(run, layout, "log_probs_after")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    for rank in run["ranks"]:  # the base weights came back bit for bit
        assert rank[layout]["restored_max_diff"] == 0.0
    after_export = _trainer_log_probs(run, layout, "log_probs_after_export")
    assert torch.equal(after_export, got)


def test_initial_a_is_seeded_and_the_same_in_every_layout(run: dict[str, Any]) -> None:
    seeded = [run["ranks"][0][layout]["seeded"] for layout in LAYOUTS]
    for other in seeded[1:]:
        assert other.keys() == seeded[0].keys()
        assert all(torch.equal(other[n], seeded[0][n]) for n in other)
    for name, value in seeded[0].items():
        if "lora_B" in name:
            assert not value.any(), name  # B starts at zero
        else:
            bound = 1 / value.shape[1] ** 0.5  # peft's kaiming_uniform(a=sqrt(5))
            assert float(value.abs().max()) <= bound and float(value.std()) > bound / 3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_rank_save_and_load(run: dict[str, Any], layout: str) -> None:
    assert run["ranks"][0][layout]["reload_equal"] is True
    # one file per (tp, pp) rank, written by data-parallel replica 0
    state = Path(run["ranks"][0][layout]["peft"]["path"]).parent / "state"
    files = sorted(p.name for p in state.glob("*.pt"))
    expected = {
        "tp2": ["adapter_tp00_pp000.pt", "adapter_tp01_pp000.pt"],
        "pp2": ["adapter_tp00_pp000.pt", "adapter_tp00_pp001.pt"],
        "dp2": ["adapter_tp00_pp000.pt"],
    }
    assert files == expected[layout]


def test_memory_figures(run: dict[str, Any]) -> None:
    step = run["ranks"][0]["dp2"]["step"]  # TP=1, PP=1: the whole model on one rank
    ratio = step["adam_bytes_adapters"] / step["adam_bytes_full"]
    print(
        f"\nLoRA rank {lora_scenarios.RANK}: {step['adapter_params']} adapter parameters "
        f"against {step['base_params']} base; AdamW state {step['adam_bytes_adapters']} B "
        f"against {step['adam_bytes_full']} B full ({ratio:.3f})"
    )
    print({layout: round(run["ranks"][0][layout]["seconds"], 1) for layout in LAYOUTS})
    assert step["optimizer_state_bytes"] == step["adam_bytes_adapters"]
    assert step["adapter_params"] == lora_scenarios.settings().parameter_count(_shape())


def test_bad_injections_are_refused_with_the_field_named(run: dict[str, Any]) -> None:
    for rank in run["ranks"]:
        errors = rank["tp2"]["errors"]
        assert "lora.rank 65 is beyond the model's hidden size 64" in errors["rank"]
        assert "lora.train_attn: the model's 1 key/value groups do not split" in errors["groups"]
        assert "tensor-parallel size 2" in errors["groups"]
