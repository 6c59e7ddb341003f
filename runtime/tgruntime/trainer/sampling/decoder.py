"""``CachedDecoder``: the trainer's own ``GPTModel`` run token by token with a KV cache.

The forward pass is rebuilt from the model's own submodules (embedding, per-layer norms,
fused QKV column-parallel linear (with Qwen2's bias and Qwen3's q/k norms, which
``get_query_key_value_tensors`` applies), megatron's rotary arithmetic, row-parallel output
projection, MLP, final norm, vocab-parallel output layer or the tied embedding), so it
reads the very parameters the trainer trains, in any tensor-parallel split, and computes the
same function as ``GPTModel.forward`` (tested to fp32 rounding). Only core attention differs:
it reads keys and values from a :class:`KVCache` instead of recomputing them.

Why not megatron's inference path: its ``StaticInferenceContext`` keeps one sequence offset
for the whole batch (prompts of different lengths need teacher-forced steps from the
shortest prompt on), the dynamic engine's paged cache and megatron's CUDA graphs need
Transformer Engine / flash-attn kernels, which neither the CPU path nor the H200 image has.
Here every row has its own position: prompts are right-padded for the prefill (causal
attention never sees the padding) and each decode step writes row ``r``'s key/value at
``pos[r]`` and attends to ``[0, pos[r]]``.

Pipeline parallelism: each stage runs its own layers over its own cache. The first stage
embeds, every stage but the last sends its output hidden states to the next (point to point),
and the last stage computes the logits and broadcasts them over its pipeline group, so every
rank of the group draws the same tokens and holds the same results. One message of
``[s, b, h]`` per stage boundary and one of ``[s, b, V]`` logits per step; no CUDA graphs
under pipelining (a captured step with send/receive was not tried).

Tensor layouts follow megatron: hidden states ``[s, b, h]``; the cache is ``[b, groups, L,
head_dim]`` per layer (this rank's key/value groups), the layout SDPA reads without a copy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from tgruntime.trainer.sampling.lean_layer import LeanLayers, lean_support
from tgruntime.trainer.sampling.rope import rotate

log = logging.getLogger(__name__)

__all__ = ["CachedDecoder", "KVCache", "unwrap_gpt"]


@dataclasses.dataclass
class KVCache:
    """Per-layer key and value buffers ``[rows, groups, length, head_dim]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def strided(self, every: int) -> KVCache:
        """A view of rows ``0, every, 2 * every, ...``."""
        if every == 1:
            return self
        return KVCache(
            keys=[k[::every] for k in self.keys], values=[v[::every] for v in self.values]
        )

    def copy_rows(self, source: torch.Tensor, *, start: int = 0, width: int) -> None:
        """Rows ``[start, start + len(source))`` take the first ``width`` positions of rows
        ``source``: a prompt prefilled once, copied to each of its samples' rows."""
        end = start + int(source.numel())
        for t in (*self.keys, *self.values):
            t[start:end, :, :width] = t[:, :, :width].index_select(0, source)


def unwrap_gpt(module: torch.nn.Module) -> Any:
    """The ``GPTModel`` inside megatron's DDP / Float16Module wrappers."""
    inner: Any = module
    while not hasattr(inner, "decoder") and hasattr(inner, "module"):
        inner = inner.module
    if not hasattr(inner, "decoder"):
        raise TypeError(f"{type(module).__name__} holds no megatron GPTModel")
    return inner


class CachedDecoder:
    """Prefill and single-token decode over one rank's ``GPTModel`` shard (no autograd)."""

    def __init__(self, module: torch.nn.Module) -> None:
        model = unwrap_gpt(module)
        if (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
            raise NotImplementedError(
                "sampling under interleaved (virtual) pipeline stages is not implemented: "
                "run the group without virtual pipeline stages"
            )
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.first = self.pp_size == 1 or parallel_state.is_pipeline_first_stage(
            ignore_virtual=True
        )
        self.last = self.pp_size == 1 or parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.model = model
        self.config = model.config
        self.layers = list(model.decoder.layers)
        self.rope = model.position_embedding_type == "rope"
        self.vocab_size = int(model.vocab_size)
        self.max_sequence_length = int(model.max_sequence_length)
        attn = self.layers[0].self_attention
        self.heads = int(attn.num_attention_heads_per_partition)
        self.groups = int(attn.num_query_groups_per_partition)
        self.head_dim = int(attn.hidden_size_per_attention_head)
        self.scale = float(attn.core_attention.softmax_scale)
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        weight = next(model.parameters())  # a pipeline stage past the first has no embedding
        self.device = weight.device
        self.dtype = weight.dtype
        self.hidden_size = int(self.config.hidden_size)
        self._freqs: torch.Tensor | None = None
        table = self.freqs()
        if table is not None and (
            self.config.rotary_interleaved or table.shape[-1] != self.head_dim
        ):
            raise NotImplementedError("the sampler's RoPE is non-interleaved over the full head")
        self.lean = self._lean(model)
        self.last_path = ""  # the last decode step's layers: lean, lean+lora or modules

    def _lean(self, model: Any) -> LeanLayers | None:
        """The lean decode layers (``TG_SAMPLER_LEAN=0``: off), or None where the model
        needs its modules (the reason is logged)."""
        if os.environ.get("TG_SAMPLER_LEAN", "1") == "0":
            return None
        reason = lean_support(model)
        if reason is not None:
            log.info("sampler: decode through the model's modules (%s)", reason)
            return None
        return LeanLayers(
            self.layers,
            groups=self.groups,
            heads=self.heads,
            head_dim=self.head_dim,
            scale=self.scale,
            tp_group=parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None,
            device=self.device,
        )

    # -- buffers ------------------------------------------------------------------------
    def allocate(self, rows: int, length: int) -> KVCache:
        shape = (rows, self.groups, length, self.head_dim)

        def buf() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        return KVCache(keys=[buf() for _ in self.layers], values=[buf() for _ in self.layers])

    def freqs(self) -> torch.Tensor | None:
        """RoPE angles ``[max_sequence_length, 1, 1, rot_dim]`` (None for learned positions)."""
        if not self.rope:
            return None
        if self._freqs is None:
            self._freqs = self.model.rotary_pos_emb.get_emb(self.max_sequence_length)
        return self._freqs

    # -- the forward pieces ---------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``tokens``/``positions`` ``[b, s]`` -> hidden ``[s, b, h]``."""
        out: torch.Tensor = self.model.embedding(input_ids=tokens, position_ids=positions)
        return out

    def _attention_prefill(
        self, layer: Any, x: torch.Tensor, cache: KVCache, index: int, freqs: torch.Tensor | None
    ) -> torch.Tensor:
        attn = layer.self_attention
        query, key, value = attn.get_query_key_value_tensors(x, None)[:3]
        if freqs is not None:
            query = apply_rotary_pos_emb(query, freqs, self.config)
            key = apply_rotary_pos_emb(key, freqs, self.config)
        s, b = query.shape[0], query.shape[1]
        k = key.permute(1, 2, 0, 3)  # [b, g, s, d]
        v = value.permute(1, 2, 0, 3)
        cache.keys[index][:, :, :s].copy_(k)
        cache.values[index][:, :, :s].copy_(v)
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3),
            k,
            v,
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.groups != self.heads,
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def _attention_decode(
        self,
        layer: Any,
        x: torch.Tensor,
        cache: KVCache,
        index: int,
        pos: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        attn = layer.self_attention
        query, key, value = attn.get_query_key_value_tensors(x, None)[:3]  # [1, b, n, d]
        b = query.shape[1]
        if rope is not None:  # (cos, sin) [1, b, 1, d]: each row at its own position
            query, key = rotate(query, *rope), rotate(key, *rope)
        rows = torch.arange(b, device=pos.device)
        cache.keys[index][rows, :, pos] = key[0]
        cache.values[index][rows, :, pos] = value[0]
        # One query token per row: the group's query heads act as the query "sequence"
        # of that group's key/value head (GQA without repeating the cache).
        q = query[0].reshape(b, self.groups, self.heads // self.groups, self.head_dim)
        out = F.scaled_dot_product_attention(
            q, cache.keys[index], cache.values[index], attn_mask=mask, scale=self.scale
        )
        return out.reshape(1, b, self.heads * self.head_dim)

    @staticmethod
    def _residual(x: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        y, bias = out
        return x + y if bias is None else x + y + bias

    def _layers(self, x: torch.Tensor, attend: Any) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            h = attend(layer, layer.input_layernorm(x), index)
            x = self._residual(x, layer.self_attention.linear_proj(h))
            x = self._residual(x, layer.mlp(layer.pre_mlp_layernorm(x)))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + output layer: hidden ``[s, b, h]`` -> full-vocabulary fp32 ``[s, b, V]``.

        Under pipeline parallelism the last stage computes them and broadcasts them to the
        other stages of its pipeline (whose ``hidden`` is only their own stage's output, of
        the same shape), so every rank draws the same tokens from the same logits."""
        if self.pp_size > 1 and not self.last:
            shared = torch.empty(
                (*hidden.shape[:2], self.vocab_size), dtype=torch.float32, device=self.device
            )
            self._from_last_stage(shared)
            return shared
        x = self.model.decoder.final_layernorm(hidden)
        # tied embeddings: the output layer holds no weight of its own (GPTModel.forward's way)
        weight = (
            self.model.shared_embedding_or_output_weight()
            if self.model.share_embeddings_and_output_weights
            else None
        )
        shard, _ = self.model.output_layer(x, weight=weight)
        if self.tp_size > 1:
            # megatron's gather_from_tensor_model_parallel_region allocates on CUDA
            parts = [torch.empty_like(shard) for _ in range(self.tp_size)]
            dist.all_gather(
                parts, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
            )
            shard = torch.cat(parts, dim=-1)
        full: torch.Tensor = shard.float().contiguous()
        if self.pp_size > 1:
            self._from_last_stage(full)
        return full

    # -- pipeline stages ------------------------------------------------------------------
    def _stage_input(self, embed: Any, shape: tuple[int, int]) -> torch.Tensor:
        """The first stage embeds; a later stage receives the previous stage's hidden
        states ``[s, b, h]`` (point to point, in the order every stage runs its layers)."""
        if self.first:
            out: torch.Tensor = embed()
            return out
        x = torch.empty((*shape, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(x, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        return x

    def _stage_output(self, x: torch.Tensor) -> None:
        if not self.last:
            dist.send(x.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())

    @staticmethod
    def _from_last_stage(t: torch.Tensor) -> None:
        dist.broadcast(
            t,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Right-padded prompts ``[b, P]`` -> hidden ``[P, b, h]``; fills the cache's first P."""
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
        freqs = self.freqs()
        freqs = None if freqs is None else freqs[:s]
        x = self._stage_input(lambda: self._embed(tokens, positions), (s, b))
        x = self._layers(x, lambda layer, h, i: self._attention_prefill(layer, h, cache, i, freqs))
        self._stage_output(x)
        return x

    @torch.no_grad()
    def prefill_prompts(
        self, prompts: list[list[int]], cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad ``prompts`` and prefill them into ``cache``'s first rows (one a prompt):
        their hidden states ``[P, len(prompts), h]`` (P: the longest prompt) and each
        prompt's last-token logits ``[len(prompts), V]``."""
        width = max(len(p) for p in prompts)
        padded = torch.zeros(len(prompts), width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64).to(self.device)
        hidden = self.prefill(padded.to(self.device), cache)
        last = hidden[lengths - 1, torch.arange(len(prompts), device=self.device)]
        return hidden, self.logits(last.unsqueeze(0))[0]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per row (``tokens``, ``pos`` ``[b]``) -> logits ``[b, V]`` (fp32).

        Writes each row's key/value at ``pos[r]`` and attends to positions ``<= pos[r]``.
        Free of host synchronisation (capturable in a CUDA graph).
        """
        b = tokens.shape[0]
        freqs = self.freqs()
        rope = None
        if freqs is not None:  # cos/sin once per step, shared by every layer
            angles = freqs[pos].reshape(1, b, 1, -1)
            rope = (torch.cos(angles).to(self.dtype), torch.sin(angles).to(self.dtype))
        span = torch.arange(cache.length, device=pos.device)
        mask = (span.unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, cache.length)
        x = self._stage_input(lambda: self._embed(tokens.unsqueeze(1), pos.unsqueeze(1)), (1, b))
        plan = False if self.lean is None else self.lean.plan()
        self.last_path = "modules" if plan is False else "lean" if plan is True else "lean+lora"
        if self.lean is not None and plan is not False:
            x = self.lean.run(
                x[0],
                cache.keys,
                cache.values,
                pos,
                mask,
                None if rope is None else (rope[0].view(b, -1), rope[1].view(b, -1)),
                lora=None if plan is True else plan,
            ).unsqueeze(0)
        else:
            x = self._layers(
                x,
                lambda layer, h, i: self._attention_decode(layer, h, cache, i, pos, mask, rope),
            )
        self._stage_output(x)
        return self.logits(x)[0]
