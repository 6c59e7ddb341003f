"""The GPT (Llama-style) transformer-layer spec the trainer builds its model from.

Only megatron-core's own local modules (no Transformer Engine, no apex): tensor-parallel
column/row linears, PyTorch norms (``torch.nn.RMSNorm`` / ``LayerNorm`` through
megatron's ``WrappedTorchNorm``), megatron's MLP (SwiGLU when the config sets
``gated_linear_unit``), and :class:`~tgruntime.trainer.sdpa_attention.SDPAttention` as core
attention in place of megatron's CUDA-buffer ``DotProductAttention``. The same spec runs on
CPU and GPU.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from tgruntime.trainer.sdpa_attention import SDPAttention

__all__ = ["gpt_layer_spec"]


def gpt_layer_spec(*, qk_norm: bool = False) -> ModuleSpec:
    """A pre-norm decoder layer: norm -> causal self-attention (SDPA) -> norm -> MLP.

    The norm type (RMSNorm/LayerNorm), the MLP activation (SwiGLU/GELU), biases and
    dropout all come from the ``TransformerConfig`` the model is built with. ``qk_norm``
    (Qwen3) norms each query and key head (the config's norm type) before RoPE.
    """
    qk = WrappedTorchNorm if qk_norm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=SDPAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk,
                    k_layernorm=qk,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
