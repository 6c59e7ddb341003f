"""Megatron GPTModel parameters <-> Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` parameters (pure functions).

The trainer's model (``model.py``) is a Llama: RMSNorm, SwiGLU, RoPE (base ``ropeTheta``), no
biases, grouped-query attention through ``num_query_groups``, embeddings tied or not. Qwen2
adds a bias to the query/key/value projections, Qwen3 an RMSNorm over each query and key
head (``model.architecture``; docs/models.md). Its megatron-core ``GPTModel`` parameters (the
same names from 0.16 to 0.19) map onto
transformers' as follows (``i`` a global layer index; megatron names with tensor-parallel
size 1, ``L = decoder.layers.i``, ``M = model.layers.i``)::

    embedding.word_embeddings.weight       model.embed_tokens.weight
    L.input_layernorm.weight               M.input_layernorm.weight
    L.self_attention.linear_qkv.weight     M.self_attn.{q,k,v}_proj.weight (fused, see below)
    L.self_attention.linear_proj.weight    M.self_attn.o_proj.weight
    L.pre_mlp_layernorm.weight             M.post_attention_layernorm.weight
    L.mlp.linear_fc1.weight                M.mlp.gate_proj.weight, then M.mlp.up_proj.weight
    L.mlp.linear_fc2.weight                M.mlp.down_proj.weight
    decoder.final_layernorm.weight         model.norm.weight
    output_layer.weight                    lm_head.weight (absent when tied)
    L.self_attention.linear_qkv.bias       M.self_attn.{q,k,v}_proj.bias (Qwen2, fused)
    L.self_attention.q_layernorm.weight    M.self_attn.q_norm.weight (Qwen3)
    L.self_attention.k_layernorm.weight    M.self_attn.k_norm.weight (Qwen3)

Tied embeddings: a one-stage model has no ``output_layer.weight`` (megatron reads the
embedding's); under pipeline parallelism the last stage holds a copy, which is imported from
``model.embed_tokens.weight`` and not exported.

Fused QKV: rows are grouped by key/value group ``g``: the ``heads/groups`` query heads of the
group, then its key head, then its value head (``head_dim`` rows each). Hugging Face keeps
query heads in order, so query head ``h`` belongs to group ``h // (heads/groups)`` in both.
Both use the non-interleaved ("rotate half") RoPE on the same per-head layout, so no row
permutation of ``q``/``k`` is needed (the log-prob tests check this numerically).

Tensor parallelism (``tp_merge``/``tp_split``): column-parallel weights (fused QKV, fc1,
the vocab-parallel embedding and output layer) are split along rows, row-parallel weights
(``linear_proj``, ``linear_fc2``) along columns, norms are replicated. The fused QKV rows
are split contiguously (when there are fewer groups than ranks a rank holds part of a
group; megatron gathers them in the forward), so concatenating the shards gives the full
tensor either way. SwiGLU's fc1 is the exception: each rank holds its slice of the gate
rows followed by its slice of the up rows, so shards are split in two before merging.

Pipeline parallelism: a stage holds a contiguous range of layers numbered from 0 in its
module names; :func:`renumber_layers` converts between local and global numbering.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from tgapi import ModelSpec
from tgapi.model import ARCHITECTURES
from tgapi.pretrained import HF_CLASSES, HF_NORM_EPSILON, SUPPORTED

__all__ = [
    "RMS_NORM_EPS",
    "ROPE_THETA",
    "LlamaShape",
    "hf_names",
    "hf_order",
    "hf_to_megatron",
    "layer_of",
    "megatron_names",
    "megatron_to_hf",
    "renumber_layers",
    "tp_merge",
    "tp_split",
]

ROPE_THETA = 10000.0  # model.ropeTheta's default
RMS_NORM_EPS = 1e-5  # model.normEpsilon's default

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# megatron suffix (inside a layer) -> how tensor parallelism shards it
_ROWS, _COLS, _REPLICATED, _GATED_ROWS = "rows", "cols", "replicated", "gated_rows"
_LAYER_SPLIT = {
    "input_layernorm.weight": _REPLICATED,
    "self_attention.linear_qkv.weight": _ROWS,
    "self_attention.linear_proj.weight": _COLS,
    "pre_mlp_layernorm.weight": _REPLICATED,
    "mlp.linear_fc1.weight": _GATED_ROWS,
    "mlp.linear_fc2.weight": _COLS,
    "self_attention.linear_qkv.bias": _ROWS,  # Qwen2
    "self_attention.q_layernorm.weight": _REPLICATED,  # Qwen3
    "self_attention.k_layernorm.weight": _REPLICATED,
}
_LLAMA_LAYER = tuple(list(_LAYER_SPLIT)[:6])
_QKV_BIAS = ("self_attention.linear_qkv.bias",)
_QK_NORM = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
_TOP_SPLIT = {
    "embedding.word_embeddings.weight": _ROWS,
    "decoder.final_layernorm.weight": _REPLICATED,
    "output_layer.weight": _ROWS,
}
_HF_LAYER_NAMES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_HF_QKV_BIAS = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_HF_QK_NORM = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """The shape of a Llama-style model (Llama, Qwen2, Qwen3): what both sides must agree on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = RMS_NORM_EPS
    rope_theta: float = ROPE_THETA
    architecture: str = "llama"
    """``llama``, ``qwen2`` (QKV bias) or ``qwen3`` (q/k RMSNorm per head)."""
    attention_head_dim: int = 0
    """The size of one head when it is not ``hidden_size / num_attention_heads`` (else 0)."""
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}"
            )
        if self.attention_head_dim == 0 and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "qwen3"

    @classmethod
    def from_model_spec(
        cls, model: ModelSpec, *, position_embedding: str, llama_only: bool = True
    ) -> LlamaShape:
        """The shape of the trainer's model; refuses models Hugging Face cannot express.

        ``position_embedding`` is the resolved one (``RuntimeSettings.position_embedding``:
        ``auto`` becomes learned positions on a CPU). With ``llama_only`` (what LoRA's
        adapters handle) a Qwen architecture or tied embeddings are refused too.
        """
        if llama_only and model.architecture != "llama":
            raise ValueError(
                f"model.architecture is {model.architecture}; only llama is supported here "
                "(Qwen2 and Qwen3 train with full weights: remove spec.lora)"
            )
        if llama_only and model.tie_embeddings:
            raise ValueError(
                "model.tieEmbeddings is true; only untied embeddings are supported here "
                "(train full weights: remove spec.lora)"
            )
        name = HF_CLASSES[model.architecture]
        if position_embedding != "rope":
            raise ValueError(
                f"a Hugging Face {name} uses RoPE; this model has {position_embedding} "
                "positions (set model.positionEmbedding: rope)"
            )
        if model.normalization != "RMSNorm":
            raise ValueError(
                f"a Hugging Face {name} uses RMSNorm, not {model.normalization} "
                "(set model.normalization: RMSNorm)"
            )
        if model.activation != "swiglu":
            raise ValueError(
                f"a Hugging Face {name} uses SwiGLU, not {model.activation} "
                "(set model.activation: swiglu)"
            )
        return cls(
            vocab_size=model.vocab_size,
            hidden_size=model.hidden_size,
            intermediate_size=model.ffn_hidden_size,
            num_layers=model.num_layers,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            max_position_embeddings=model.max_sequence_length,
            rms_norm_eps=model.norm_epsilon,
            rope_theta=model.rope_theta,
            architecture=model.architecture,
            attention_head_dim=_explicit_head_dim(
                model.head_dim, model.hidden_size, model.num_attention_heads
            ),
            tie_embeddings=model.tie_embeddings,
        )

    def hf_config(self, *, dtype: torch.dtype) -> dict[str, Any]:
        """``config.json`` for transformers' class of this architecture (4.x and 5.x read it)."""
        config: dict[str, Any] = {
            "architectures": [HF_CLASSES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,  # transformers 4.x
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},  # 5.x
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings,
            "initializer_range": 0.02,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if self.architecture == "llama":
            config.update(attention_bias=False, mlp_bias=False)
        else:  # Qwen2 / Qwen3: full attention in every layer
            config.update(use_sliding_window=False, sliding_window=None)
            config["max_window_layers"] = self.num_layers
            config["layer_types"] = ["full_attention"] * self.num_layers
        if self.architecture == "qwen3":
            config["attention_bias"] = False
        return config

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaShape:
        """Read a Llama, Qwen2 or Qwen3 ``config.json``; refuses what the trainer's model
        cannot express (naming the key)."""
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or model_type not in HF_CLASSES:
            raise ValueError(
                f"config.json: model_type is {model_type!r}, which the trainer does not build; "
                f"supported: {SUPPORTED}"
            )
        required = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        missing = [k for k in required if k not in config]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        checks: dict[str, tuple[Any, Any]] = {
            "hidden_act": (config.get("hidden_act", "silu"), "silu"),
            "mlp_bias": (bool(config.get("mlp_bias", False)), False),
        }
        if model_type != "qwen2":  # Qwen2's q/k/v biases are not optional
            checks["attention_bias"] = (bool(config.get("attention_bias", False)), False)
        if model_type != "llama":
            checks["use_sliding_window"] = (bool(config.get("use_sliding_window", False)), False)
            kinds = sorted(set(config.get("layer_types") or ["full_attention"]))
            checks["layer_types"] = (kinds, ["full_attention"])
        for field, (got, want) in checks.items():
            if got != want:
                raise ValueError(
                    f"config.json: {field} is {got!r}; the trainer's {model_type} needs {want!r}"
                )
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling")
        rope_type = rope.get("rope_type", "default")
        if scaling or rope_type != "default":
            raise ValueError(
                f"config.json: rope scaling {scaling or rope_type!r} is not supported "
                "(the trainer uses plain RoPE)"
            )
        theta = float(rope.get("rope_theta", config.get("rope_theta", ROPE_THETA)))
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            max_position_embeddings=int(config.get("max_position_embeddings", 0)),
            rms_norm_eps=float(config.get("rms_norm_eps", HF_NORM_EPSILON)),
            rope_theta=theta,
            architecture=model_type,
            attention_head_dim=_explicit_head_dim(
                int(config.get("head_dim") or 0), hidden, heads
            ),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def check_compatible(self, other: LlamaShape, *, source: str) -> None:
        """Raise naming every field where ``other`` (read from ``source``) differs."""
        fields = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "max_position_embeddings"
            and getattr(self, f.name) != getattr(other, f.name)
        ]
        if fields:
            diffs = "; ".join(
                f"{name}: model {getattr(self, name)!r}, {source} {getattr(other, name)!r}"
                for name in fields
            )
            raise ValueError(f"{source} does not match this group's model ({diffs})")

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face parameter name with its shape, in checkpoint order."""
        h, v, f, d = self.hidden_size, self.vocab_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        per_layer: dict[str, tuple[int, ...]] = {
            "input_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        if self.qkv_bias:
            per_layer.update(dict(zip(_HF_QKV_BIAS, ((q,), (kv,), (kv,)), strict=True)))
        if self.qk_norm:
            per_layer.update(dict.fromkeys(_HF_QK_NORM, (d,)))
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for i in range(self.num_layers):
            out.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
        out["model.norm.weight"] = (h,)
        if not self.tie_embeddings:
            out["lm_head.weight"] = (v, h)
        return out


def _explicit_head_dim(head_dim: int, hidden: int, heads: int) -> int:
    """``head_dim`` when it is not ``hidden / heads`` (else 0: the default)."""
    return 0 if head_dim == 0 or head_dim * heads == hidden else head_dim


# -- names and layers ---------------------------------------------------------------
def layer_of(name: str) -> int | None:
    """The layer index in a megatron or Hugging Face parameter name (None outside layers)."""
    match = _LAYER.match(name) or _HF_LAYER.match(name)
    return int(match.group(1)) if match else None


def renumber_layers(state: Mapping[str, torch.Tensor], *, offset: int) -> dict[str, torch.Tensor]:
    """Add ``offset`` to every megatron layer index (local -> global: the stage's first layer;
    global -> local: minus it)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _LAYER.match(name)
        if match:
            name = f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"
        out[name] = tensor
    return out


def megatron_names(
    *,
    layers: Iterable[int],
    first_stage: bool,
    last_stage: bool,
    shape: LlamaShape | None = None,
) -> list[str]:
    """The megatron parameter names of a pipeline stage (layers numbered as given) of a model
    of ``shape`` (default: a Llama with untied embeddings)."""
    suffixes = list(_LLAMA_LAYER)
    if shape is not None and shape.qkv_bias:
        suffixes += _QKV_BIAS
    if shape is not None and shape.qk_norm:
        suffixes += _QK_NORM
    names = ["embedding.word_embeddings.weight"] if first_stage else []
    for i in layers:
        names += [f"decoder.layers.{i}.{suffix}" for suffix in suffixes]
    if last_stage:
        names.append("decoder.final_layernorm.weight")
        # tied: one stage reads the embedding's weight; the last of several holds a copy
        if shape is None or not shape.tie_embeddings or not first_stage:
            names.append("output_layer.weight")
    return names


def hf_names(
    *,
    layers: Iterable[int],
    first_stage: bool,
    last_stage: bool,
    shape: LlamaShape | None = None,
) -> list[str]:
    """The Hugging Face parameter names of the same stage, in checkpoint order. With tied
    embeddings the last stage reads ``model.embed_tokens.weight`` (for its output layer)."""
    per_layer = list(_HF_LAYER_NAMES)
    if shape is not None and shape.qkv_bias:
        per_layer += _HF_QKV_BIAS
    if shape is not None and shape.qk_norm:
        per_layer += _HF_QK_NORM
    tied = shape is not None and shape.tie_embeddings
    names = ["model.embed_tokens.weight"] if first_stage else []
    for i in layers:
        names += [f"model.layers.{i}.{suffix}" for suffix in per_layer]
    if last_stage:
        names.append("model.norm.weight")
        if not tied:
            names.append("lm_head.weight")
        elif not first_stage:
            names.append("model.embed_tokens.weight")
    return names


def _split_rule(name: str) -> str:
    match = _LAYER.match(name)
    rule = _LAYER_SPLIT.get(match.group(2)) if match else _TOP_SPLIT.get(name)
    if rule is None:
        raise KeyError(f"{name!r} is not a parameter of the trainer's Llama-style GPTModel")
    return rule


# -- tensor parallelism -------------------------------------------------------------
def tp_merge(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full (tensor-parallel size 1) tensor of ``name`` from its shards, in TP rank order."""
    if not shards:
        raise ValueError(f"{name}: no shards to merge")
    rule = _split_rule(name)
    if rule == _REPLICATED or len(shards) == 1:
        return shards[0]
    if rule == _ROWS:
        return torch.cat(list(shards), dim=0)
    if rule == _COLS:
        return torch.cat(list(shards), dim=1)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]  # _GATED_ROWS: [gate_r; up_r]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def tp_split(name: str, full: torch.Tensor, *, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s shard of the full tensor ``name`` (a contiguous copy)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside tensor-parallel size {tp_size}")
    rule = _split_rule(name)
    if rule == _REPLICATED or tp_size == 1:
        return full.clone()
    dim = 1 if rule == _COLS else 0
    if full.shape[dim] % (2 * tp_size if rule == _GATED_ROWS else tp_size):
        raise ValueError(
            f"{name}: dimension {dim} of size {full.shape[dim]} does not split over "
            f"tensor-parallel size {tp_size}"
        )
    if rule == _GATED_ROWS:
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat(
            [torch.chunk(gate, tp_size, dim=0)[tp_rank], torch.chunk(up, tp_size, dim=0)[tp_rank]]
        ).contiguous()
    return torch.chunk(full, tp_size, dim=dim)[tp_rank].contiguous()


# -- megatron <-> Hugging Face --------------------------------------------------------
def _layers(state: Mapping[str, torch.Tensor], pattern: re.Pattern[str]) -> list[int]:
    found = {int(m.group(1)) for m in map(pattern.match, state) if m}
    return sorted(found)


def _take(state: Mapping[str, torch.Tensor], name: str, *, side: str) -> torch.Tensor:
    try:
        return state[name]
    except KeyError:
        raise KeyError(f"{side} weights lack {name!r}") from None


def _own(piece: torch.Tensor) -> torch.Tensor:
    """A piece of a fused tensor with storage of its own (safetensors refuses shared storage)."""
    return piece.clone(memory_format=torch.contiguous_format)


def megatron_to_hf(state: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Full (TP size 1, global layer numbers) megatron tensors -> Hugging Face tensors.

    ``state`` may hold one pipeline stage (whole layers, plus the embedding on the first
    stage and the final norm and output layer on the last); the result holds the same part.
    Names other than the trainer's parameters (e.g. ``_extra_state``) must be dropped first.
    """
    unknown = [n for n in state if n.endswith("_extra_state")]
    if unknown:
        raise ValueError(f"drop megatron's _extra_state entries before converting: {unknown[:3]}")
    for name in state:
        _split_rule(name)  # every name must be known
    g, per, d = shape.num_key_value_heads, shape.heads_per_group, shape.head_dim
    out: dict[str, torch.Tensor] = {}
    if "embedding.word_embeddings.weight" in state:
        out["model.embed_tokens.weight"] = state["embedding.word_embeddings.weight"]
    for i in _layers(state, _LAYER):
        src = f"decoder.layers.{i}."
        dst = f"model.layers.{i}."

        def get(suffix: str, prefix: str = src) -> torch.Tensor:
            return _take(state, prefix + suffix, side="megatron")

        qkv = get("self_attention.linear_qkv.weight")
        grouped = qkv.view(g, (per + 2) * d, shape.hidden_size)
        q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
        if shape.qkv_bias:
            bias = get("self_attention.linear_qkv.bias").view(g, (per + 2) * d)
            for hf_name, piece in zip(
                _HF_QKV_BIAS, torch.split(bias, [per * d, d, d], dim=1), strict=True
            ):
                out[dst + hf_name] = _own(piece.reshape(-1))
        if shape.qk_norm:
            for hf_name, suffix in zip(_HF_QK_NORM, _QK_NORM, strict=True):
                out[dst + hf_name] = get(suffix)
        fc1 = get("mlp.linear_fc1.weight")
        gate, up = torch.chunk(fc1, 2, dim=0)
        out.update(
            {
                dst + "input_layernorm.weight": get("input_layernorm.weight"),
                dst + "self_attn.q_proj.weight": _own(q.reshape(-1, shape.hidden_size)),
                dst + "self_attn.k_proj.weight": _own(k.reshape(-1, shape.hidden_size)),
                dst + "self_attn.v_proj.weight": _own(v.reshape(-1, shape.hidden_size)),
                dst + "self_attn.o_proj.weight": get("self_attention.linear_proj.weight"),
                dst + "post_attention_layernorm.weight": get("pre_mlp_layernorm.weight"),
                dst + "mlp.gate_proj.weight": _own(gate),
                dst + "mlp.up_proj.weight": _own(up),
                dst + "mlp.down_proj.weight": get("mlp.linear_fc2.weight"),
            }
        )
    if "decoder.final_layernorm.weight" in state:
        out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if "output_layer.weight" in state and not shape.tie_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return hf_order(out, shape)


def hf_order(state: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """``state`` in checkpoint order (:meth:`LlamaShape.hf_shapes`)."""
    order = {name: i for i, name in enumerate(shape.hf_shapes())}
    return {n: state[n] for n in sorted(state, key=lambda n: order.get(n, len(order)))}


def hf_to_megatron(state: Mapping[str, torch.Tensor], shape: LlamaShape) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> full (TP size 1) megatron tensors with the same layer numbers.

    The inverse of :func:`megatron_to_hf`; ``state`` may likewise hold one stage's part.
    Shapes are checked against ``shape``.
    """
    expected = shape.hf_shapes()
    for name, tensor in state.items():
        want = expected.get(name)
        if want is None:
            raise ValueError(f"{name!r} is not a parameter of a {shape.architecture} of this shape")
        if tuple(tensor.shape) != want:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {want}")
    g, per, d, h = (
        shape.num_key_value_heads,
        shape.heads_per_group,
        shape.head_dim,
        shape.hidden_size,
    )
    out: dict[str, torch.Tensor] = {}
    if "model.embed_tokens.weight" in state:
        out["embedding.word_embeddings.weight"] = state["model.embed_tokens.weight"]
        if shape.tie_embeddings:  # the last stage's copy, where there are several stages
            out["output_layer.weight"] = state["model.embed_tokens.weight"]
    for i in _layers(state, _HF_LAYER):
        src = f"model.layers.{i}."
        dst = f"decoder.layers.{i}."

        def get(suffix: str, prefix: str = src) -> torch.Tensor:
            return _take(state, prefix + suffix, side="Hugging Face")

        q = get("self_attn.q_proj.weight").view(g, per * d, h)
        k = get("self_attn.k_proj.weight").view(g, d, h)
        v = get("self_attn.v_proj.weight").view(g, d, h)
        out.update(
            {
                dst + "input_layernorm.weight": get("input_layernorm.weight"),
                dst + "self_attention.linear_qkv.weight": torch.cat([q, k, v], dim=1).reshape(
                    -1, h
                ),
                dst + "self_attention.linear_proj.weight": get("self_attn.o_proj.weight"),
                dst + "pre_mlp_layernorm.weight": get("post_attention_layernorm.weight"),
                dst + "mlp.linear_fc1.weight": torch.cat(
                    [get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], dim=0
                ),
                dst + "mlp.linear_fc2.weight": get("mlp.down_proj.weight"),
            }
        )
        if shape.qkv_bias:
            qb = get("self_attn.q_proj.bias").view(g, per * d)
            kb = get("self_attn.k_proj.bias").view(g, d)
            vb = get("self_attn.v_proj.bias").view(g, d)
            out[dst + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        if shape.qk_norm:
            for hf_name, suffix in zip(_HF_QK_NORM, _QK_NORM, strict=True):
                out[dst + suffix] = get(hf_name)
    if "model.norm.weight" in state:
        out["decoder.final_layernorm.weight"] = state["model.norm.weight"]
    if "lm_head.weight" in state:
        out["output_layer.weight"] = state["lm_head.weight"]
    return out
