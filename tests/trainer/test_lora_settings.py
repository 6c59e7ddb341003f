"""LoRA settings, PEFT config reading and the optimizer helper's refusals (one process, no
torch.distributed): every bad input is refused with the field named and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from tgruntime.trainer.hf_weights import LlamaShape
from tgruntime.trainer.lora import (
    DEFAULT_RANK,
    LoraAdapters,
    LoraSettings,
    adapter_config,
    build_adapter_training_state,
    import_peft,
    initial_a,
    read_peft,
)
from tgruntime.trainer.lora.state import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def _shape(hidden: int = 64, groups: int = 2) -> LlamaShape:
    return LlamaShape(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=groups,
        max_position_embeddings=32,
    )


def test_defaults_mirror_tinkers_lora_config() -> None:
    tinker = pytest.importorskip("tinker")
    sdk = tinker.types.LoraConfig(rank=DEFAULT_RANK)
    ours = LoraSettings()
    for field in ("rank", "train_attn", "train_mlp", "train_unembed"):
        assert getattr(ours, field) == getattr(sdk, field), field
    assert LoraSettings.from_mapping(sdk.model_dump()) == ours  # seed None -> 0
    assert ours.scaling == 1.0 and LoraSettings(rank=8, alpha=16).scaling == 2.0
    assert ours.hf_targets() == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, r"lora.rank is 0 .*train_attn, train_mlp, train_unembed"),
        ({"rank": -1}, r"lora.rank must be >= 1"),
        ({"rank": 2.5}, r"lora.rank must be an integer"),
        ({"rank": True}, r"lora.rank must be an integer"),
        ({"alpha": 0}, r"lora.alpha must be a number > 0"),
        ({"alpha": "8"}, r"lora.alpha must be a number > 0"),
        ({"train_mlp": "yes"}, r"lora.train_mlp must be true or false"),
        ({"seed": None}, r"lora.seed must be an integer"),
        (
            {"rank": 8, "train_attn": False, "train_mlp": False, "train_unembed": False},
            r"nothing to adapt",
        ),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoraSettings(**kwargs)


def test_rank_zero_without_switches_is_a_full_weight_run() -> None:
    off = LoraSettings(rank=0, train_attn=False, train_mlp=False, train_unembed=False)
    assert not off.enabled and off.parameter_count(_shape()) == 0
    off.check_shape(_shape())  # nothing to check


def test_unknown_field_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown field 'train_embed'.*known fields: alpha"):
        LoraSettings.from_mapping({"rank": 8, "train_embed": True})


def test_rank_beyond_the_hidden_size_or_a_projection() -> None:
    with pytest.raises(ValueError, match=r"lora.rank 65 is beyond the model's hidden size 64"):
        LoraSettings(rank=65).check_shape(_shape())
    # k_proj of 1 group x 16 dims: 64 -> 16
    with pytest.raises(ValueError, match=r"beyond self_attn.k_proj's size \(64 -> 16\)"):
        LoraSettings(rank=32).check_shape(_shape(groups=1))
    LoraSettings(rank=32, train_attn=False).check_shape(_shape(groups=1))
    LoraSettings(rank=64).check_shape(_shape(groups=4))


def test_parameter_count() -> None:
    shape = _shape()  # per layer: q 64+64, k 64+32, v 64+32, o 64+64, gate/up 64+128, down 128+64
    per_layer = 128 + 96 + 96 + 128 + 192 + 192 + 192
    assert LoraSettings(rank=4).parameter_count(shape) == 4 * (2 * per_layer + 64 + 128)
    only_mlp = LoraSettings(rank=4, train_attn=False, train_unembed=False)
    assert only_mlp.parameter_count(shape) == 4 * 2 * 576


def test_initial_a_is_peft_distributed_and_seeded() -> None:
    a = initial_a(hf_module="model.layers.0.self_attn.q_proj", rank=8, in_features=256, seed=1)
    assert a.shape == (8, 256) and a.dtype == torch.float32
    assert float(a.abs().max()) <= 1 / 16 and float(a.std()) == pytest.approx(
        1 / 16 / 3**0.5, rel=0.1
    )
    same = initial_a(hf_module="model.layers.0.self_attn.q_proj", rank=8, in_features=256, seed=1)
    other = initial_a(hf_module="model.layers.0.self_attn.k_proj", rank=8, in_features=256, seed=1)
    reseeded = initial_a(
        hf_module="model.layers.0.self_attn.q_proj", rank=8, in_features=256, seed=2
    )
    assert torch.equal(a, same) and not torch.equal(a, other) and not torch.equal(a, reseeded)


def _peft_dir(tmp_path: Path, **changes: Any) -> Path:
    config = {**adapter_config(LoraSettings(rank=4, alpha=8)), **changes}
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / ADAPTER_WEIGHTS))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_modules": ["q_proj", "embed_tokens"]}, r"target_modules \['embed_tokens'\]"),
        ({"target_modules": ".*proj"}, r"target_modules as a regex"),
        ({"target_modules": ["q_proj", "v_proj"]}, r"all or none of"),
        ({"use_dora": True}, r"use_dora"),
        ({"peft_type": "IA3"}, r"peft_type 'IA3'"),
    ],
)
def test_peft_configs_we_cannot_load_are_named(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        read_peft(_peft_dir(tmp_path, **changes))


def test_import_of_another_adapter_names_the_field(tmp_path: Path) -> None:
    settings, _ = read_peft(_peft_dir(tmp_path))
    assert (settings.rank, settings.alpha) == (4, 8.0)
    adapters = LoraAdapters(settings=LoraSettings(rank=8, alpha=8), shape=_shape())
    with pytest.raises(ValueError, match=r"lora.rank is 4; these adapters have 8"):
        import_peft(adapters, tmp_path)
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        read_peft(tmp_path / "nowhere")


def test_optimizer_helper_refuses_an_unfrozen_base_and_fp16() -> None:
    import tgapi

    spec = tgapi.parse_spec({}, local=True).optimizer
    adapters = LoraAdapters(settings=LoraSettings(rank=4), shape=_shape())
    base = torch.nn.Linear(4, 4)

    class Config:
        fp16 = False

    with pytest.raises(ValueError, match="freeze the base model first"):
        build_adapter_training_state(base, adapters=adapters, config=Config(), spec=spec)
    base.requires_grad_(False)
    Config.fp16 = True
    with pytest.raises(ValueError, match="fp16"):
        build_adapter_training_state(base, adapters=adapters, config=Config(), spec=spec)
