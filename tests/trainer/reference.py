"""A plain-PyTorch reference of the trainer's GPT (no megatron), for gradient checks.

``merge_shards`` rebuilds the full, unsharded weights (or gradients) from each rank's
tensor/pipeline shard, in megatron's TP=1 layout with global layer numbers;
``forward_logits`` is the same decoder written out (learned absolute positions, RMSNorm,
SwiGLU, grouped-query causal attention, untied output layer).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def rank_shards(module: torch.nn.Module, *, grads: bool) -> dict[str, Any]:
    """This rank's parameters (or gradients) with what merging needs (run on a rank)."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    out: dict[str, Any] = {}
    for name, p in module.named_parameters():
        value = p.grad if grads else p.data
        assert value is not None, name
        m = _LAYER.match(name)
        if m:  # local layer index -> global (stages hold equal shares of the layers)
            local = int(m.group(1))
            per_stage = len(module.decoder.layers)  # type: ignore[union-attr,arg-type]
            name = f"decoder.layers.{local + pp_rank * per_stage}." + name[m.end() :]
        split = getattr(p, "tensor_model_parallel", False)
        dim = getattr(p, "partition_dim", None) if split else None
        out[name] = (value.detach().double().cpu().clone(), dim)
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "tensors": out}


def merge_shards(ranks: list[dict[str, Any]], *, glu: bool = True) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's :func:`rank_shards` (TP concatenated, PP united)."""
    pieces: dict[str, dict[int, tuple[torch.Tensor, int | None]]] = {}
    for r in ranks:
        for name, (value, dim) in r["tensors"].items():
            pieces.setdefault(name, {})[r["tp_rank"]] = (value, dim)
    full: dict[str, torch.Tensor] = {}
    for name, by_tp in pieces.items():
        parts = [by_tp[i] for i in sorted(by_tp)]
        dim = parts[0][1]
        if dim is None or len(parts) == 1:
            full[name] = parts[0][0]
        elif glu and name.endswith("mlp.linear_fc1.weight"):
            halves = [v.chunk(2, dim=0) for v, _ in parts]  # each shard: [gate_r; up_r]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            full[name] = torch.cat([v for v, _ in parts], dim=dim)
    return full


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def forward_logits(
    w: dict[str, torch.Tensor], tokens: torch.Tensor, *, heads: int, groups: int, layers: int
) -> torch.Tensor:
    """Logits [b, s, V] of the decoder with weights ``w`` (TP=1 megatron names)."""
    b, s = tokens.shape
    x = w["embedding.word_embeddings.weight"][tokens]
    x = x + w["embedding.position_embeddings.weight"][:s].unsqueeze(0)
    hidden = x.shape[-1]
    hn = hidden // heads
    per_group = heads // groups
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(layers):
        p = f"decoder.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        qkv = (h @ w[p + "self_attention.linear_qkv.weight"].T).view(
            b, s, groups, (per_group + 2) * hn
        )
        q, k, v = torch.split(qkv, [per_group * hn, hn, hn], dim=-1)
        q = q.reshape(b, s, heads, hn).transpose(1, 2)  # [b, heads, s, hn]
        k = k.transpose(1, 2).repeat_interleave(per_group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(per_group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hn)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, hidden)
        x = x + attn @ w[p + "self_attention.linear_proj.weight"].T
        h = _rms(x, w[p + "pre_mlp_layernorm.weight"])
        gate, up = (h @ w[p + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ w[p + "mlp.linear_fc2.weight"].T
    x = _rms(x, w["decoder.final_layernorm.weight"])
    return x @ w["output_layer.weight"].T


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[b, S-1]: log p(tokens[:, j+1] | tokens[:, :j+1])."""
    logp = logits[:, :-1].log_softmax(-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
