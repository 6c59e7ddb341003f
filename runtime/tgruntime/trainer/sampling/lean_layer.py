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
not reproduce. Forward hooks on a layer's modules are checked at every step by
:meth:`LeanLayers.plan`: a hook adds to a module's output what these functions would skip,
so any hook sends the step to the modules, except one kind. The per-row adapters of the
continuous engine's LoRA stack (``lora.multi.StackHook``, one per adapted linear of one
``MultiLora``) are computed here from the stack's own buffers: per adapted linear ``x A^T``
(``[b, keys x width]``; every slot's columns), times the row mask (each row keeps its own
slot's columns, scaled), times the fused ``B`` (``[out, keys x width]``, the combiner of the
fused q/k/v or gate/up layout applied once when the stack is filled), added to the base
linear's output; for a row-parallel linear the partial ``x A^T`` is summed over the tensor
ranks first, as the hook does. Two small GEMMs and a multiply, fused with the rest of the
layer when compiled, where the hooks ran the layer through its modules (about 2.7x the
full-weight step on the seed shape, docs/sampling.md). ``TG_SAMPLER_LEAN_LORA=0`` sends
LoRA steps to the modules again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tgruntime.trainer.lora.multi import StackedLinear, StackHook
from tgruntime.trainer.sampling.decode_attention import decode_attention
from tgruntime.trainer.sampling.rope import rotate

__all__ = [
    "LayerShape",
    "LeanLayers",
    "LoraTerms",
    "lean_support",
    "post_attention",
    "pre_attention",
]


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
    qkv_a: torch.Tensor | None = None,
    qkv_f: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused QKV (megatron's layout: per key/value group its query heads, then its key
    and value) with its per-row LoRA delta (``qkv_a``, ``qkv_f``, ``mask``: the module
    docstring; None: none), per-head q/k norms, non-interleaved RoPE at each row's own
    position. ``x`` ``[b, h]`` -> query ``[b, g, q per group, d]``, key and value
    ``[b, g, d]``."""
    b, d = x.shape[0], shape.head_dim
    per_group = shape.heads // shape.groups
    h = _apply_norm(x, *shape.norm, n1_w, n1_b)
    qkv = F.linear(h, qkv_w, qkv_b)
    if qkv_a is not None and qkv_f is not None and mask is not None:
        qkv = qkv + _lora_out(F.linear(h, qkv_a), qkv_f, mask)
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
    proj_a: torch.Tensor | None = None,
    proj_f: torch.Tensor | None = None,
    fc1_a: torch.Tensor | None = None,
    fc1_f: torch.Tensor | None = None,
    fc2_a: torch.Tensor | None = None,
    fc2_f: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-parallel projection (an all-reduce of the partial sums under tensor parallelism),
    residual, pre-MLP norm, ``act(gate) * up`` (or ``act``), down projection, residual; each
    linear with its per-row LoRA delta where its ``*_a``/``*_f`` are given."""
    x = x + _row_parallel(attn, proj_w, proj_b, tp_group, proj_a, proj_f, mask)
    h = _apply_norm(x, *shape.norm, n2_w, n2_b)
    u = F.linear(h, fc1_w, fc1_b)
    if fc1_a is not None and fc1_f is not None and mask is not None:
        u = u + _lora_out(F.linear(h, fc1_a), fc1_f, mask)
    if shape.gated:
        gate, up = torch.chunk(u, 2, dim=-1)
        u = shape.act(gate) * up
    else:
        u = shape.act(u)
    return x + _row_parallel(u, fc2_w, fc2_b, tp_group, fc2_a, fc2_f, mask)


def _lora_out(h: torch.Tensor, fused: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``h = x A^T`` ``[b, keys x width]`` -> each row's delta ``[b, out]``: the row's own
    slot's columns kept and scaled (``mask`` ``[b, width]``, the same for every key), then the
    fused ``B``."""
    b, width = h.shape[0], mask.shape[-1]
    kept = (h.view(b, -1, width) * mask.unsqueeze(1)).view(b, -1)
    return F.linear(kept, fused)


def _row_parallel(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: Any,
    lora_a: torch.Tensor | None = None,
    lora_f: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    y = F.linear(x, weight)
    h = None if lora_a is None else F.linear(x, lora_a)
    if group is not None:
        dist.all_reduce(y, group=group)
        if h is not None:  # the partial x A^T of this rank's input columns, as the hook's
            dist.all_reduce(h, group=group)
    if h is not None and lora_f is not None and mask is not None:
        y = y + _lora_out(h, lora_f, mask)
    return y if bias is None else y + bias


@dataclasses.dataclass(frozen=True)
class LoraTerms:
    """One step's per-row adapters for the lean layers: per layer the stacked adapters of
    its QKV, projection, FC1 and FC2 (None: not adapted), and the row mask they share."""

    linears: list[tuple[StackedLinear | None, ...]]
    mask: torch.Tensor


def _pair(linear: StackedLinear | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if linear is None else (linear.a, linear.fused)


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
        self._linears = [
            (
                layer.self_attention.linear_qkv,
                layer.self_attention.linear_proj,
                layer.mlp.linear_fc1,
                layer.mlp.linear_fc2,
            )
            for layer in layers
        ]
        self._linear_ids = {id(m) for four in self._linears for m in four}
        self.compiled = compile_wanted(device=device, tp=tp_group is not None)

    def plan(self) -> LoraTerms | bool:
        """Whether this step can run here: True with no hook on the layers' modules; the
        :class:`LoraTerms` to add when the only hooks are one ``MultiLora``'s on the four
        linears (module docstring); False for any other hook (the modules compute it)."""
        if not any(m._forward_hooks or m._forward_pre_hooks for m in self._hooked):
            return True
        if os.environ.get("TG_SAMPLER_LEAN_LORA", "1") == "0":
            return False
        if any(
            m._forward_pre_hooks or (m._forward_hooks and id(m) not in self._linear_ids)
            for m in self._hooked
        ):
            return False
        owners: dict[int, Any] = {}
        linears: list[tuple[StackedLinear | None, ...]] = []
        for four in self._linears:
            found: list[StackedLinear | None] = []
            for module in four:
                hooks = list(module._forward_hooks.values())
                if not hooks:
                    found.append(None)
                    continue
                if len(hooks) > 1 or not isinstance(hooks[0], StackHook):
                    return False
                owners[id(hooks[0].owner)] = hooks[0].owner
                found.append(hooks[0].linear)
            linears.append(tuple(found))
        if len(owners) != 1:
            return False
        (owner,) = owners.values()
        return LoraTerms(linears=linears, mask=owner.mask)

    def run(
        self,
        x: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        pos: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        lora: LoraTerms | None = None,
    ) -> torch.Tensor:
        """Every layer over ``x`` ``[b, h]``; writes each row's key/value at ``pos[r]``;
        adds ``lora``'s per-row deltas (:meth:`plan`)."""
        cos, sin = rope if rope is not None else (None, None)
        shape = self.shape
        none: tuple[StackedLinear | None, ...] = (None, None, None, None)
        rows = None if lora is None else lora.mask
        pre, post = (pre_attention, post_attention)
        if self.compiled:
            kind = "base" if rows is None else "uniform" if rows.shape[0] == 1 else "rows"
            pre, post = _compiled(kind)
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attention, layer.mlp
            qkv, proj, fc1, fc2 = none if lora is None else lora.linears[index]
            q, k, v = pre(
                x,
                *_norm_tensors(layer.input_layernorm),
                attn.linear_qkv.weight,
                attn.linear_qkv.bias,
                *_norm_tensors(attn.q_layernorm),
                *_norm_tensors(attn.k_layernorm),
                cos,
                sin,
                shape,
                *_pair(qkv),
                rows,
            )
            out = decode_attention(q, k, v, keys[index], values[index], pos, shape.scale, mask=mask)
            x = post(
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
                *_pair(proj),
                *_pair(fc1),
                *_pair(fc2),
                rows,
            )
        return x


# One pair of functions per kind of step, each its own code object: Dynamo keeps its compiled
# variants per code object, at most ``recompile_limit`` (8) of them, and runs the plain function
# for any call past that. Each kind takes about three (a first batch size, a second, then a
# dynamic batch): the three kinds at three batch sizes make 9 (tests/trainer/test_sampler.py,
# on the CPU), so with one pair for every kind the steps that came last ran uncompiled.


def _pre_base(*args: Any) -> Any:
    return pre_attention(*args)


def _post_base(*args: Any) -> Any:
    return post_attention(*args)


def _pre_rows(*args: Any) -> Any:
    return pre_attention(*args)


def _post_rows(*args: Any) -> Any:
    return post_attention(*args)


def _pre_uniform(*args: Any) -> Any:
    return pre_attention(*args)


def _post_uniform(*args: Any) -> Any:
    return post_attention(*args)


_KINDS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "base": (_pre_base, _post_base),  # no adapters
    "rows": (_pre_rows, _post_rows),  # a LoRA stack, one mask row per batch row
    "uniform": (_pre_uniform, _post_uniform),  # a LoRA stack's one-row (uniform) map
}
_COMPILED: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


def _compiled(kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The compiled pair of ``kind`` (:data:`_KINDS`), made once per process: every sampler
    of the process (the one-shot path's, the continuous engine's, the warm-up's) shares the
    graphs Dynamo caches for it."""
    if kind not in _COMPILED:
        pre, post = _KINDS[kind]
        _COMPILED[kind] = (
            torch.compile(pre, fullgraph=True),
            torch.compile(post, fullgraph=True),
        )
    return _COMPILED[kind]


def compile_wanted(*, device: torch.device, tp: bool) -> bool:
    """``TG_SAMPLER_COMPILE``: 1 on, 0 off; unset: on for CUDA without tensor parallelism
    (where it was measured; a compiled all-reduce was not tried)."""
    setting = os.environ.get("TG_SAMPLER_COMPILE", "")
    if setting in ("0", "1"):
        return setting == "1"
    return device.type == "cuda" and not tp
