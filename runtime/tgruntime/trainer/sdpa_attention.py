"""Core attention for megatron-core built on PyTorch's ``scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the full ``[b*np, sq, sk]`` score
matrix in a buffer taken from a global *CUDA* memory pool, so it cannot run on the CPU,
and on a GPU it is unfused (slower, about twice the activation memory). This module has
the same constructor and ``forward`` signature, so it plugs into
``SelfAttentionSubmodules.core_attention`` of a layer spec, and hands the work to
``torch.nn.functional.scaled_dot_product_attention``: flash / memory-efficient kernels on
a GPU, the fused CPU kernel on a CPU.

Shapes follow megatron: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (``np``
and ``ng`` are this tensor-parallel rank's query heads and key/value groups; with GQA
``ng < np``), output ``[sq, b, np * hn]``. Head counts are read from the tensors, so the
module is correct for any tensor-parallel split megatron's ``Attention`` produces.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SDPAttention"]


class SDPAttention(MegatronModule):  # type: ignore[misc]
    """Causal (or masked) softmax attention through ``F.scaled_dot_product_attention``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SDPAttention does not implement context parallelism "
                "(that needs Transformer Engine's attention); set parallelism.context to 1"
            )
        if config.window_size is not None:
            raise ValueError("SDPAttention does not implement sliding-window attention")
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SDPAttention supports softmax_type 'vanilla', not {config.softmax_type!r}"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        # apply_query_key_layer_scaling only rescales for fp16 range; the product is the same.
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPAttention does not support packed sequences")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support an attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, n_heads, head_dim = query.shape
        n_groups = key.shape[2]

        # [s, b, h, d] -> [b, h, s, d]: views; SDPA accepts strided inputs.
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)

        is_causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if not is_causal and attention_mask is not None:
            # megatron's convention: True = masked out; SDPA's boolean mask: True = attend.
            mask = ~attention_mask.bool()
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = {"enable_gqa": True} if n_groups != n_heads else {}

        def attend() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                **kwargs,
            )

        if dropout_p > 0.0 and q.is_cuda and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        # [b, h, s, d] -> [s, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n_heads * head_dim)
