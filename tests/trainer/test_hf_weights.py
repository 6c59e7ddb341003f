"""Pure unit tests of the Hugging Face conversion (no Ray, no torch.distributed).

HF state dict -> megatron -> TP shards -> merged -> HF must be bit-identical for every
grouping of heads and tensor-parallel size (including fewer key/value groups than ranks);
names and shapes must be those of transformers' own ``LlamaForCausalLM``; the config and
safetensors files must load in transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import tgapi
from tgruntime.trainer import hf_files
from tgruntime.trainer.hf_weights import (
    LlamaShape,
    hf_names,
    hf_to_megatron,
    layer_of,
    megatron_names,
    megatron_to_hf,
    renumber_layers,
    tp_merge,
    tp_split,
)

transformers = pytest.importorskip("transformers")


def _shape(heads: int = 4, groups: int = 2, layers: int = 2) -> LlamaShape:
    return LlamaShape(
        vocab_size=96,
        hidden_size=16 * heads,
        intermediate_size=48,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=groups,
        max_position_embeddings=32,
    )


def _random_hf(shape: LlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shape.hf_shapes().items()}


def _hf_model(shape: LlamaShape) -> torch.nn.Module:
    config = transformers.LlamaConfig.from_dict(shape.hf_config(dtype=torch.float32))
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config)
    return model


def test_names_and_shapes_are_transformers_own() -> None:
    shape = _shape()
    model = _hf_model(shape)
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert theirs == shape.hf_shapes()
    assert list(shape.hf_shapes()) == hf_names(
        layers=range(shape.num_layers), first_stage=True, last_stage=True
    )


@pytest.mark.parametrize(
    ("heads", "groups", "tp"),
    [(4, 4, 2), (4, 2, 2), (4, 1, 2), (8, 2, 4), (4, 2, 1)],
    ids=["mha-tp2", "gqa-tp2", "mqa-tp2", "gqa-fewer-groups-than-ranks-tp4", "tp1"],
)
def test_round_trip_through_tensor_parallel_shards_is_bit_identical(
    heads: int, groups: int, tp: int
) -> None:
    shape = _shape(heads=heads, groups=groups)
    hf = _random_hf(shape)
    full = hf_to_megatron(hf, shape)
    assert set(full) == set(megatron_names(layers=range(2), first_stage=True, last_stage=True))
    shards = [
        {n: tp_split(n, t, tp_size=tp, tp_rank=r) for n, t in full.items()} for r in range(tp)
    ]
    merged = {n: tp_merge(n, [s[n] for s in shards]) for n in full}
    back = megatron_to_hf(merged, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_layouts_follow_megatron() -> None:
    """QKV rows per group are [its query heads, its key head, its value head]; fc1 is
    [gate; up] and each TP rank holds [its gate rows; its up rows]."""
    shape = _shape(heads=4, groups=2)
    d, h = shape.head_dim, shape.hidden_size
    hf = _random_hf(shape)
    full = hf_to_megatron(hf, shape)
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k = (
        hf["model.layers.0.self_attn.q_proj.weight"],
        hf["model.layers.0.self_attn.k_proj.weight"],
    )
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    group1 = qkv[4 * d : 8 * d]  # group 1: query heads 2 and 3, key head 1, value head 1
    assert torch.equal(group1, torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    fc1_rank1 = tp_split(
        "decoder.layers.0.mlp.linear_fc1.weight",
        full["decoder.layers.0.mlp.linear_fc1.weight"],
        tp_size=2,
        tp_rank=1,
    )
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1_rank1, torch.cat([gate[24:], up[24:]]))
    assert fc1_rank1.shape == (48, h)
    proj = tp_split(
        "decoder.layers.0.self_attention.linear_proj.weight",
        full["decoder.layers.0.self_attention.linear_proj.weight"],
        tp_size=2,
        tp_rank=0,
    )
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, : h // 2])


def test_pipeline_stages_convert_on_their_own() -> None:
    shape = _shape(layers=4)
    hf = _random_hf(shape)
    full = hf_to_megatron(hf, shape)
    stage1_names = megatron_names(layers=range(2, 4), first_stage=False, last_stage=True)
    stage1 = {n: full[n] for n in stage1_names}
    local = renumber_layers(stage1, offset=-2)
    assert sorted({i for n in local if (i := layer_of(n)) is not None}) == [0, 1]
    back = megatron_to_hf(renumber_layers(local, offset=2), shape)
    assert list(back) == hf_names(layers=range(2, 4), first_stage=False, last_stage=True)
    assert all(torch.equal(back[n], hf[n]) for n in back)


def test_config_round_trips_through_transformers() -> None:
    shape = _shape()
    config = transformers.LlamaConfig.from_dict(shape.hf_config(dtype=torch.bfloat16))
    assert config.num_key_value_heads == 2 and config.tie_word_embeddings is False
    assert LlamaShape.from_hf_config(config.to_dict()) == shape
    assert LlamaShape.from_hf_config(shape.hf_config(dtype=torch.float32)) == shape


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"model_type": "gemma2"}, r"model_type is 'gemma2'.*supported: llama"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling"),
    ],
)
def test_config_refuses_what_the_trainer_cannot_express(
    change: dict[str, object], message: str
) -> None:
    config = {**_shape().hf_config(dtype=torch.float32), **change}
    with pytest.raises(ValueError, match=message):
        LlamaShape.from_hf_config(config)


def test_config_lacking_a_field_is_named() -> None:
    config = _shape().hf_config(dtype=torch.float32)
    del config["vocab_size"]
    with pytest.raises(ValueError, match="lacks vocab_size"):
        LlamaShape.from_hf_config(config)


def test_shape_mismatch_names_the_fields() -> None:
    other = dataclasses.replace(_shape(), num_layers=3, vocab_size=64)
    with pytest.raises(ValueError, match=r"vocab_size: model 96, cfg 64.*num_layers"):
        _shape().check_compatible(other, source="cfg")


def test_model_spec_must_be_a_llama() -> None:
    base = {"vocabSize": 96, "hiddenSize": 64, "numAttentionHeads": 4, "ffnHiddenSize": 48}
    model = tgapi.parse_spec({"model": base}, local=True).model
    assert LlamaShape.from_model_spec(model, position_embedding="rope").num_key_value_heads == 4
    with pytest.raises(ValueError, match="positionEmbedding: rope"):
        LlamaShape.from_model_spec(model, position_embedding="learned_absolute")
    for key, value in (("normalization", "LayerNorm"), ("activation", "gelu")):
        other = tgapi.parse_spec({"model": {**base, key: value}}, local=True).model
        with pytest.raises(ValueError, match=f"model.{key}"):
            LlamaShape.from_model_spec(other, position_embedding="rope")


def test_bad_inputs_are_named() -> None:
    shape = _shape()
    with pytest.raises(KeyError, match="not a parameter"):
        tp_split("decoder.layers.0.mlp.linear_fc3.weight", torch.zeros(4), tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="does not split"):
        tp_split("output_layer.weight", torch.zeros(5, 2), tp_size=2, tp_rank=0)
    bad = _random_hf(shape)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"lm_head.weight: shape \(3, 3\)"):
        hf_to_megatron(bad, shape)
    with pytest.raises(ValueError, match="_extra_state"):
        megatron_to_hf({"output_layer._extra_state": torch.zeros(1)}, shape)


# -- files ----------------------------------------------------------------------------
def test_plan_shards_respects_the_limit() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 9), ("d", 1)]
    assert hf_files.plan_shards(sizes, max_shard_bytes=8) == [["a", "b"], ["c"], ["d"]]
    assert hf_files.plan_shards(sizes, max_shard_bytes=100) == [["a", "b", "c", "d"]]
    assert hf_files.shard_names(1) == ["model.safetensors"]
    assert hf_files.shard_names(2)[1] == "model-00002-of-00002.safetensors"


@pytest.mark.parametrize("max_bytes", [10**9, 20_000], ids=["one-file", "sharded"])
def test_files_load_in_transformers(tmp_path: Path, max_bytes: int) -> None:
    shape = _shape()
    hf = _random_hf(shape, seed=3)
    size = 4
    plan = hf_files.plan_shards(
        [(n, t.numel() * size) for n, t in hf.items()], max_shard_bytes=max_bytes
    )
    files = hf_files.shard_names(len(plan))
    (tmp_path / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    hf_files.clear_weights(tmp_path)
    total = sum(
        hf_files.write_shard(tmp_path / f, {n: hf[n] for n in names})
        for f, names in zip(files, plan, strict=True)
    )
    if len(files) > 1:
        weights = {n: f for f, names in zip(files, plan, strict=True) for n in names}
        hf_files.write_index(tmp_path, weights=weights, total_size=total)
    hf_files.write_config(tmp_path, shape.hf_config(dtype=torch.float32))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors") == files
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in hf.items())
    some = ["lm_head.weight", "model.layers.1.mlp.up_proj.weight"]
    read = hf_files.read_tensors(tmp_path, some)
    assert all(torch.equal(read[n], hf[n]) for n in some)
    with pytest.raises(KeyError, match="lacks 1 weights"):
        hf_files.read_tensors(tmp_path, ["model.layers.7.mlp.up_proj.weight"])
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float32"


def test_missing_checkpoint_is_explained(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        hf_files.read_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="safe_serialization"):
        hf_files.weight_map(tmp_path)
