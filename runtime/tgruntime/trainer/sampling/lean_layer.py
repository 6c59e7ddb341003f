"""The decode step's transformer layer as one plain function over the layer's tensors.

:class:`~tgruntime.trainer.sampling.decoder.CachedDecoder` runs a decode step through the
layer's megatron submodules: about 35 kernels a layer (norm pieces, the fused-QKV split,
RoPE pieces, the cache writes, masked SDPA, the SwiGLU pieces, residual adds). Inside a CUDA
graph the host cost of those calls is gone, but every kernel still costs a few microseconds
on the device: on the seed shape at batch 32 the small kernels, not the weight reads, set the
step time (30% of the memory-bandwidth bound on an H200, docs/sampling.md).

Here the same arithmetic is two plain functions over tensors: :func:`pre_attention` (norm,
QKV, q/k norms, RoPE) and :func:`post_attention` (projection, residual, norm, MLP,
residual), with the cache writes and SDPA between them. They take the layer's own
parameters, read at every step, so training updates and snapshot swaps are seen, and the
shape's constants. Eager, they already save the module plumbing; on a GPU with tensor
parallel size 1 each is compiled once with ``torch.compile`` (every layer has the same
shapes and constants, so one compiled graph serves all of them, and the batch dimension
becomes symbolic after the second bucket), which fuses the norm, RoPE, activation and
residual pieces into a few Triton kernels around the four GEMMs. The cache writes and
the attention stay outside the compiled graphs (no compiled graph mutates its inputs): they
are one Triton kernel on a GPU (``decode_attention.py``) that reads each row's live
positions only. The compiled
function launches no host synchronisation, so the decode step is still captured in the
sampler's CUDA graphs.

:func:`lean_support` says why a model cannot take this path (then the module path runs):
norms other than PyTorch's RMSNorm/LayerNorm, sequence parallelism, fewer key/value groups
than tensor-parallel ranks, gated attention output, megatron MLP options this function does
not reproduce. Forward hooks on a layer's linears (LoRA adapters) are checked at every step
by :meth:`LeanLayers.usable`: the hooks add deltas this function would skip.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tgruntime.trainer.sampling.decode_attention import decode_attention
from tgruntime.trainer.sampling.rope import rotate

__all__ = ["LayerShape", "LeanLayers", "lean_support", "post_attention", "pre_attention"]


def _norm(module: Any) -> tuple[str, float | None] | None:
    """A norm's kind (``rms``/``layer``) and eps; None for megatron's identity; raises for
    any other norm."""
    if module is None or type(module).__name__ == "IdentityOp":
        return None
    if isinstance(module, torch.nn.RMSNorm):
        return ("rms", module.eps)
    if isinstance(module, torch.nn.LayerNorm):
        return ("layer", float(module.eps))
    raise TypeError(f"norm {type(module).__name__} is not PyTorch's RMSNorm or LayerNorm")


def _apply_norm(
    x: torch.Tensor, kind: str, eps: float | None, w: torch.Tensor | None, b: torch.Tensor | None
) -> torch.Tensor:
    shape = (int(x.shape[-1]),)
    if kind == "rms":
        return F.rms_norm(x, shape, w, eps)
    return F.layer_norm(x, shape, w, b, 1e-5 if eps is None else eps)


def _norm_tensors(module: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if module is None or type(module).__name__ == "IdentityOp":
        return None, None
    return module.weight, getattr(module, "bias", None)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What every layer shares: head counts, scale, norm kinds, activation (the compiled
    function's constants)."""

    groups: int
    heads: int
    head_dim: int
    scale: float
    norm: tuple[str, float | None]
    qk_norm: tuple[str, float | None] | None
    act: Callable[[torch.Tensor], torch.Tensor]
    gated: bool


def lean_support(model: Any) -> str | None:
    """Why ``model`` (an unwrapped ``GPTModel``) cannot take the lean step; None if it can."""
    config = model.config
    checks: list[tuple[bool, str]] = [
        (bool(getattr(config, "sequence_parallel", False)), "sequence parallelism"),
        (bool(getattr(config, "attention_output_gate", False)), "gated attention output"),
        (bool(getattr(config, "fp32_residual_connection", False)), "fp32 residual connection"),
        (
            bool(getattr(config, "apply_residual_connection_post_layernorm", False)),
            "residual after the norm",
        ),
        (getattr(config, "activation_func_clamp_value", None) is not None, "activation clamp"),
        (float(getattr(config, "glu_linear_offset", 0.0) or 0.0) != 0.0, "GLU linear offset"),
        (bool(getattr(config, "num_moe_experts", None)), "mixture of experts"),
    ]
    for failed, what in checks:
        if failed:
            return what
    layers = list(model.decoder.layers)
    if not layers:
        return "no layers"
    attn = layers[0].self_attention
    tp = int(getattr(attn, "world_size", 1) or 1)
    if config.num_query_groups is not None and config.num_query_groups < tp:
        return "fewer key/value groups than tensor-parallel ranks"
    outer: set[Any] = set()
    inner: set[Any] = set()
    for layer in layers:
        if type(layer.mlp).__name__ != "MLP":
            return f"MLP class {type(layer.mlp).__name__}"
        attn = layer.self_attention
        try:
            outer.update((_norm(layer.input_layernorm), _norm(layer.pre_mlp_layernorm)))
            inner.update((_norm(attn.q_layernorm), _norm(attn.k_layernorm)))
        except TypeError as err:
            return str(err)
    if len(outer) != 1 or None in outer or len(inner) != 1:
        return "norms that differ between layers or positions"
    return None


def pre_attention(
    x: torch.Tensor,
    n1_w: torch.Tensor | None,
    n1_b: torch.Tensor | None,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    qn_w: torch.Tensor | None,
    qn_b: torch.Tensor | None,
    kn_w: torch.Tensor | None,
    kn_b: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    shape: LayerShape,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused QKV (megatron's layout: per key/value group its query heads, then its key
    and value), per-head q/k norms, non-interleaved RoPE at each row's own position.
    ``x`` ``[b, h]`` -> query ``[b, g, q per group, d]``, key and value ``[b, g, d]``."""
    b, d = x.shape[0], shape.head_dim
    per_group = shape.heads // shape.groups
    qkv = F.linear(_apply_norm(x, *shape.norm, n1_w, n1_b), qkv_w, qkv_b)
    qkv = qkv.view(b, shape.groups, per_group + 2, d)
    q = qkv[:, :, :per_group]
    k = qkv[:, :, per_group]
    v = qkv[:, :, per_group + 1]
    if shape.qk_norm is not None:
        q = _apply_norm(q, *shape.qk_norm, qn_w, qn_b)
        k = _apply_norm(k, *shape.qk_norm, kn_w, kn_b)
    if cos is not None and sin is not None:  # [b, d]
        q = rotate(q, cos.view(b, 1, 1, d), sin.view(b, 1, 1, d))
        k = rotate(k, cos.view(b, 1, d), sin.view(b, 1, d))
    return q, k, v


def post_attention(
    x: torch.Tensor,
    attn: torch.Tensor,
    proj_w: torch.Tensor,
    proj_b: torch.Tensor | None,
    n2_w: torch.Tensor | None,
    n2_b: torch.Tensor | None,
    fc1_w: torch.Tensor,
    fc1_b: torch.Tensor | None,
    fc2_w: torch.Tensor,
    fc2_b: torch.Tensor | None,
    shape: LayerShape,
    tp_group: Any,
) -> torch.Tensor:
    """Row-parallel projection (an all-reduce of the partial sums under tensor parallelism),
    residual, pre-MLP norm, ``act(gate) * up`` (or ``act``), down projection, residual."""
    x = x + _row_parallel(attn, proj_w, proj_b, tp_group)
    u = F.linear(_apply_norm(x, *shape.norm, n2_w, n2_b), fc1_w, fc1_b)
    if shape.gated:
        gate, up = torch.chunk(u, 2, dim=-1)
        u = shape.act(gate) * up
    else:
        u = shape.act(u)
    return x + _row_parallel(u, fc2_w, fc2_b, tp_group)


def _row_parallel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any
) -> torch.Tensor:
    y = F.linear(x, weight)
    if group is not None:
        dist.all_reduce(y, group=group)
    return y if bias is None else y + bias


class LeanLayers:
    """The decode step's layers through :func:`pre_attention` and :func:`post_attention`
    (compiled where that pays); the cache writes and the attention stay eager."""

    def __init__(
        self,
        layers: list[Any],
        *,
        groups: int,
        heads: int,
        head_dim: int,
        scale: float,
        tp_group: Any,
        device: torch.device,
    ) -> None:
        first = layers[0]
        config = first.config
        norm = _norm(first.input_layernorm)
        assert norm is not None
        self.shape = LayerShape(
            groups=groups,
            heads=heads,
            head_dim=head_dim,
            scale=scale,
            norm=norm,
            qk_norm=_norm(first.self_attention.q_layernorm),
            act=config.activation_func,
            gated=bool(config.gated_linear_unit),
        )
        self.layers = layers
        self.tp_group = tp_group
        self._hooked = [
            m
            for layer in layers
            for m in (
                layer,
                layer.input_layernorm,
                layer.pre_mlp_layernorm,
                layer.self_attention,
                layer.self_attention.linear_qkv,
                layer.self_attention.linear_proj,
                layer.mlp,
                layer.mlp.linear_fc1,
                layer.mlp.linear_fc2,
            )
        ]
        self.compiled = compile_wanted(device=device, tp=tp_group is not None)
        pair: tuple[Callable[..., Any], Callable[..., Any]] = (
            _compiled() if self.compiled else (pre_attention, post_attention)
        )
        self._pre, self._post = pair

    def usable(self) -> bool:
        """False while any layer module carries forward hooks (LoRA adapters add deltas)."""
        return not any(m._forward_hooks or m._forward_pre_hooks for m in self._hooked)

    def run(
        self,
        x: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        pos: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Every layer over ``x`` ``[b, h]``; writes each row's key/value at ``pos[r]``."""
        cos, sin = rope if rope is not None else (None, None)
        shape = self.shape
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attention, layer.mlp
            q, k, v = self._pre(
                x,
                *_norm_tensors(layer.input_layernorm),
                attn.linear_qkv.weight,
                attn.linear_qkv.bias,
                *_norm_tensors(attn.q_layernorm),
                *_norm_tensors(attn.k_layernorm),
                cos,
                sin,
                shape,
            )
            out = decode_attention(q, k, v, keys[index], values[index], pos, shape.scale, mask=mask)
            x = self._post(
                x,
                out.reshape(x.shape[0], shape.heads * shape.head_dim),
                attn.linear_proj.weight,
                attn.linear_proj.bias,
                *_norm_tensors(layer.pre_mlp_layernorm),
                mlp.linear_fc1.weight,
                mlp.linear_fc1.bias,
                mlp.linear_fc2.weight,
                mlp.linear_fc2.bias,
                shape,
                self.tp_group,
            )
        return x


_COMPILED: list[tuple[Callable[..., Any], Callable[..., Any]]] = []


def _compiled() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The compiled pair, made once per process: every sampler of the process (the one-shot
    path's, the continuous engine's, the warm-up's) shares the graphs Dynamo caches for it."""
    if not _COMPILED:
        _COMPILED.append(
            (
                torch.compile(pre_attention, fullgraph=True),
                torch.compile(post_attention, fullgraph=True),
            )
        )
    return _COMPILED[0]


def compile_wanted(*, device: torch.device, tp: bool) -> bool:
    """``TG_SAMPLER_COMPILE``: 1 on, 0 off; unset: on for CUDA without tensor parallelism
    (where it was measured; a compiled all-reduce was not tried)."""
    setting = os.environ.get("TG_SAMPLER_COMPILE", "")
    if setting in ("0", "1"):
        return setting == "1"
    return device.type == "cuda" and not tp
