"""Build megatron-core's ``GPTModel`` (a Llama/GPT-style decoder) from the spec's ``ModelSpec``.

``transformer_config`` maps the spec onto megatron's ``TransformerConfig`` (bf16/fp16 on a
GPU, fp32 and CPU initialisation on a CPU, SwiGLU/RMSNorm per spec, no biases but Qwen2's
QKV bias, Qwen3's q/k norms, no dropout; docs/models.md); ``build_gpt_model`` builds this
pipeline stage's part of the model with the SDPA layer spec (embeddings tied per
``model.tieEmbeddings``, RoPE base ``model.ropeTheta``), on the right device and dtype. On
a GPU two elementwise chains run as torch.compile'd kernels (``compiled_fusions``;
``TG_TORCH_COMPILE=0`` turns them off): SwiGLU through megatron's own
``bias_activation_fusion`` and megatron's unfused RoPE function (``compile_rope``); on the
seed shape on one H200 they took the step from 299.6 to 253.5 ms (docs/gpu.md, "The group's
own overhead"), at ~25 s of compilation in the first step.
``seed_everything`` seeds the RNGs the way megatron's training loop does (distinct per
pipeline stage, megatron's tensor-parallel CUDA RNG tracker on a GPU). Model-parallel state
must already be initialised.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from tgapi import ModelSpec, ParallelismSpec
from tgruntime.trainer.layer_spec import gpt_layer_spec
from tgruntime.trainer.rotary import make_rotary_cpu_safe
from tgruntime.trainer.settings import RuntimeSettings

__all__ = [
    "build_gpt_model",
    "compile_rope",
    "compiled_fusions",
    "count_parameters",
    "seed_everything",
    "transformer_config",
]


def compiled_fusions(settings: RuntimeSettings) -> bool:
    """Whether the torch.compile'd SwiGLU and RoPE are used: on a GPU, unless
    ``TG_TORCH_COMPILE=0`` (a CPU run keeps megatron's eager code: no compiler needed), and
    only where Triton can build its launcher: an image without a C compiler keeps the eager
    code instead of failing the first step."""
    if not settings.on_gpu or os.environ.get("TG_TORCH_COMPILE", "1") == "0":
        return False
    return c_compiler() is not None


def c_compiler() -> str | None:
    """The C compiler Triton would use (``$CC``, else cc, gcc or clang on PATH), or None."""
    found = os.environ.get("CC") or next(
        (p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None
    )
    return found or None


def compile_rope() -> bool:
    """Route megatron's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``: per tensor two
    multiplies, a negation, two concatenations) through ``torch.compile``: one kernel forward
    and one backward instead of ~6 passes over q and k. megatron's fused RoPE needs Transformer
    Engine, which the trainer does not use. Process-wide and idempotent; the arithmetic is
    megatron's own. False when this megatron has no such function (nothing changed)."""
    from megatron.core.models.common.embeddings import rope_utils

    fn = getattr(rope_utils, "_apply_rotary_pos_emb_bshd", None)
    if fn is None:
        return False
    if getattr(fn, "__tg_compiled__", False):
        return True
    compiled = torch.compile(fn)
    setattr(compiled, "__tg_compiled__", True)  # noqa: B010 (a function attribute)
    rope_utils._apply_rotary_pos_emb_bshd = compiled
    return True


def transformer_config(
    model: ModelSpec, parallelism: ParallelismSpec, settings: RuntimeSettings
) -> TransformerConfig:
    """The ``TransformerConfig`` for ``model`` under ``parallelism`` on this machine."""
    swiglu = model.activation == "swiglu"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        tensor_model_parallel_size=parallelism.tensor,
        pipeline_model_parallel_size=parallelism.pipeline,
        context_parallel_size=parallelism.context,
        sequence_parallel=False,
        # precision
        params_dtype=settings.dtype,
        pipeline_dtype=settings.dtype,
        bf16=settings.dtype == torch.bfloat16,
        fp16=settings.dtype == torch.float16,
        use_cpu_initialization=not settings.on_gpu,
        perform_initialization=True,
        # architecture (Llama-style)
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,  # Qwen2
        qk_layernorm=model.qk_norm,  # Qwen3 (the layer spec builds the norms)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        # megatron's SwiGLU fusion is torch.compile (its jit_fuser), no apex or TE: on a GPU
        bias_activation_fusion=swiglu and compiled_fusions(settings),
        # no apex / Transformer Engine: keep every fusion that needs them off
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        persist_layer_norm=False,
    )


def seed_everything(seed: int, *, settings: RuntimeSettings) -> None:
    """Seed Python, NumPy and torch like megatron's training loop (offset per pipeline stage)."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    if settings.on_gpu:
        # Tensor-parallel-aware CUDA RNG tracker (used by GPU initialisation and dropout).
        tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def build_gpt_model(
    model: ModelSpec, config: TransformerConfig, settings: RuntimeSettings
) -> GPTModel:
    """This rank's stage of the GPT model, on ``settings.device`` in ``settings.dtype``."""
    # megatron copies the embedding to the last stage with a CUDA all-reduce: on a CPU with
    # several stages the model is built untied and tied here (_tie_across_stages)
    tie_here = model.tie_embeddings and (
        settings.on_gpu or parallel_state.get_pipeline_model_parallel_world_size() == 1
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(qk_norm=model.qk_norm),
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=tie_here,
        position_embedding_type=settings.position_embedding,
        rotary_base=model.rope_theta,  # a float (megatron annotates int; RoPE takes any)
    )
    if model.tie_embeddings and not tie_here:
        _tie_across_stages(gpt)
    if settings.on_gpu:
        # Norms and position embeddings are plain torch modules created on the CPU in fp32.
        gpt.cuda(torch.cuda.current_device())
        if settings.position_embedding == "rope" and compiled_fusions(settings):
            compile_rope()
    else:
        make_rotary_cpu_safe(gpt)
    gpt.to(dtype=settings.dtype)
    return gpt


def _tie_across_stages(gpt: GPTModel) -> None:
    """megatron's ``setup_embeddings_and_output_layer`` for several pipeline stages, on a CPU:
    the last stage's output weight starts as the first stage's embedding (an all-reduce over
    megatron's embedding group of a zeroed copy), both flagged ``shared_embedding`` (their
    gradients are summed over that group after each backward: ``finalize_grads_local``) and
    the copy ``shared`` (counted once in the gradient norm)."""
    gpt.share_embeddings_and_output_weights = True
    weight = gpt.shared_embedding_or_output_weight()
    if gpt.pre_process and not gpt.post_process:
        weight.shared_embedding = True
    if gpt.post_process and not gpt.pre_process:
        weight.data.fill_(0)
        weight.shared = True
        weight.shared_embedding = True
    if parallel_state.is_rank_in_embedding_group():
        torch.distributed.all_reduce(weight.data, group=parallel_state.get_embedding_group())


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters held by this rank (a tensor-parallel shard of one pipeline stage)."""
    return sum(p.numel() for p in module.parameters())
