"""``spec.model.pretrained``: the shape from config.json where the files are at hand
(``local=True``: the runtime, tgctl), and what is checked without them (the operator, the CRD)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import tgapi
from tgapi import crd

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
}


def _checkpoint(
    tmp_path: Path, config: dict[str, Any] | None = None, tokenizer: bool = True
) -> str:
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return str(d)


def _spec(path: str, **model: Any) -> dict[str, Any]:
    return {
        "model": {"pretrained": path, "positionEmbedding": "rope", **model},
        "training": {"batchSize": 2, "sequenceLength": 64},
    }


def _errors(spec: dict[str, Any], *, local: bool) -> list[str]:
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec, local=local)
    return [str(e) for e in info.value.errors]


def test_the_shape_comes_from_config_json_where_the_files_are(tmp_path: Path) -> None:
    spec = tgapi.parse_spec(_spec(_checkpoint(tmp_path)), local=True)
    m = spec.model
    assert (m.vocab_size, m.hidden_size, m.ffn_hidden_size, m.num_layers) == (128, 64, 96, 2)
    assert (m.num_attention_heads, m.num_query_groups, m.max_sequence_length) == (4, 2, 256)


def test_a_written_field_that_agrees_is_fine_one_that_contradicts_is_named(
    tmp_path: Path,
) -> None:
    path = _checkpoint(tmp_path)
    assert tgapi.parse_spec(_spec(path, hiddenSize=64), local=True).model.hidden_size == 64
    (err,) = _errors(_spec(path, hiddenSize=2048), local=True)
    assert err.startswith("spec.model.hiddenSize: 2048 contradicts hidden_size = 64 in ")
    assert "Fix: remove model.hiddenSize (the checkpoint gives the shape) or set it to 64" in err


def test_a_missing_tokenizer_directory_or_config_is_a_clear_error(tmp_path: Path) -> None:
    (err,) = _errors(_spec(_checkpoint(tmp_path, tokenizer=False)), local=True)
    assert err.startswith("spec.model.pretrained: ") and "holds no tokenizer" in err
    (err,) = _errors(_spec(str(tmp_path / "absent")), local=True)
    assert "is not a directory here" in err and "Fix:" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (err,) = _errors(_spec(str(empty)), local=True)
    assert "holds no config.json" in err


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [
        ("gpt2", "GPT2LMHeadModel"),
        ("mistral", "MistralForCausalLM"),
        ("gemma2", "Gemma2ForCausalLM"),
    ],
)
def test_another_architecture_is_refused(
    tmp_path: Path, model_type: str, architecture: str
) -> None:
    config = {**CONFIG, "model_type": model_type, "architectures": [architecture]}
    (err,) = _errors(_spec(_checkpoint(tmp_path, config)), local=True)
    assert err.startswith("spec.model.pretrained: ")
    assert f"describes model_type '{model_type}' ({architecture}), which the trainer" in err
    assert (
        "supported: llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM)"
        in err
    )
    # a known model_type with another class in architectures is refused too
    config = {**CONFIG, "model_type": "qwen2", "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "other").mkdir()
    (err,) = _errors(_spec(_checkpoint(tmp_path / "other", config)), local=True)
    assert "model_type 'qwen2' (LlamaForCausalLM)" in err


QWEN3 = {
    **CONFIG,
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "head_dim": 32,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


def test_config_json_sets_the_architecture_and_its_fields(tmp_path: Path) -> None:
    m = tgapi.parse_spec(_spec(_checkpoint(tmp_path, QWEN3)), local=True).model
    assert (m.architecture, m.head_dim, m.kv_channels) == ("qwen3", 32, 32)
    assert (m.rope_theta, m.norm_epsilon, m.tie_embeddings) == (1e6, 1e-6, True)
    assert m.qk_norm and not m.qkv_bias
    # transformers 5.x writes rope_theta inside rope_parameters; a head_dim of hidden/heads
    # is the default (0)
    qwen2 = {**QWEN3, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    qwen2.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del qwen2["rope_theta"], qwen2["tie_word_embeddings"]
    for sub in ("q2", "l"):
        (tmp_path / sub).mkdir()
    m = tgapi.parse_spec(_spec(_checkpoint(tmp_path / "q2", qwen2)), local=True).model
    assert (m.architecture, m.head_dim, m.kv_channels, m.rope_theta) == ("qwen2", 0, 16, 5e5)
    assert m.qkv_bias and not m.qk_norm and not m.tie_embeddings
    # a Llama keeps its config's rope_theta and rms_norm_eps (transformers' 1e-6 if absent)
    m = tgapi.parse_spec(_spec(_checkpoint(tmp_path / "l", CONFIG)), local=True).model
    assert (m.architecture, m.rope_theta, m.norm_epsilon) == ("llama", 10000.0, 1e-6)


@pytest.mark.parametrize(
    ("field", "value", "key", "want"),
    [
        ("architecture", "llama", "model_type", "qwen3"),
        ("headDim", 16, "head_dim", "32"),
        ("ropeTheta", 10000, "rope_theta", "1000000.0"),
        ("normEpsilon", 1e-5, "rms_norm_eps", "1e-06"),
        ("tieEmbeddings", False, "tie_word_embeddings", "true"),
    ],
)
def test_a_written_field_that_contradicts_config_json_is_named(
    tmp_path: Path, field: str, value: Any, key: str, want: str
) -> None:
    path = _checkpoint(tmp_path, QWEN3)
    (err,) = _errors(_spec(path, **{field: value}), local=True)
    assert err.startswith(f"spec.model.{field}: ") and f"contradicts {key} = {want} in " in err
    assert f"Fix: remove model.{field} (the checkpoint gives it) or set it to {want}" in err
    agree = {"architecture": "qwen3", "headDim": 32, "ropeTheta": 1e6, "tieEmbeddings": True}
    assert tgapi.parse_spec(_spec(path, **agree), local=True).model.head_dim == 32


def test_a_qwen_architecture_without_files_needs_the_llama_fields() -> None:
    spec: dict[str, Any] = {"model": {"architecture": "qwen3", "activation": "gelu"}}
    errs = _errors(spec, local=True)
    assert errs == [
        "spec.model.positionEmbedding: is auto but model.architecture qwen3 uses rotary "
        "positions (auto picks learned positions on a CPU). Fix: set "
        "model.positionEmbedding: rope, or model.architecture: llama",
        "spec.model.activation: is gelu but model.architecture qwen3 has a SwiGLU MLP. Fix: "
        "set model.activation: swiglu, or model.architecture: llama",
    ]
    ok: dict[str, Any] = {"architecture": "qwen2", "positionEmbedding": "rope", "headDim": 48}
    spec = {"model": {**ok, "hiddenSize": 100, "numAttentionHeads": 8}}
    model = tgapi.parse_spec(spec, local=True).model
    assert model.kv_channels == 48  # hiddenSize need not divide by the heads with headDim
    (err,) = _errors({"model": {**ok, "architecture": "mistral"}}, local=True)
    assert err == (
        "spec.model.architecture: 'mistral' is not allowed. Fix: use one of llama, qwen2, qwen3"
    )


def test_the_operator_checks_the_path_and_the_llama_fields_only(tmp_path: Path) -> None:
    spec = {**_spec("/volume/not-here"), "rayClusterRef": {"name": "rc"}}
    # no files read without local=True: the shape is the spec's own
    assert tgapi.parse_spec(spec).model.pretrained == "/volume/not-here"
    errs = _errors(
        {
            "model": {
                "pretrained": "/volume/llama",
                "normalization": "LayerNorm",
                "activation": "gelu",
            },
            "rayClusterRef": {"name": "rc"},
        },
        local=False,
    )
    assert errs == [
        "spec.model.positionEmbedding: is auto but model.pretrained is a Llama checkpoint, "
        "which uses rotary positions (auto picks learned positions on a CPU). Fix: set "
        "model.positionEmbedding: rope, or remove model.pretrained",
        "spec.model.normalization: is LayerNorm but model.pretrained is a Llama checkpoint, "
        "which uses RMSNorm. Fix: set model.normalization: RMSNorm, or remove model.pretrained",
        "spec.model.activation: is gelu but model.pretrained is a Llama checkpoint, whose MLP "
        "is SwiGLU. Fix: set model.activation: swiglu, or remove model.pretrained",
    ]
    (err,) = _errors({**spec, "model": {"pretrained": "relative/dir/x"}}, local=False)
    assert err.startswith("spec.model.pretrained: 'relative/dir/x' has the wrong format")


def test_the_crd_states_the_llama_rules_and_the_api_fields() -> None:
    text = crd.render()
    assert "has(self.model.pretrained)" in text
    assert "apiURL" in text and ".status.apiURL" in text
    spec = tgapi.parse_spec({"rayClusterRef": {"name": "rc"}})
    assert spec.api.tinker is True and spec.api.server.port == 8000
    assert spec.api.server.replicas == 1 and spec.model.pretrained is None
