"""Forward/backward over micro-batches: megatron's pipeline schedules, or a CPU equivalent.

The forward-step functions megatron's schedules call live in
:mod:`tgruntime.trainer.token_steps` (log-probs and the registered losses).

On a GPU the trainer runs megatron's own ``get_forward_backward_func()`` (no pipelining,
or 1F1B with pipeline parallelism). Those schedules allocate token counters and p2p
shape buffers on CUDA unconditionally, so on the CPU :func:`local_forward_backward` runs
the same contract: same arguments, same loss scaling, same ``forward_data_store`` result,
``config.finalize_model_grads_func`` called at the end, and pipeline parallelism as an
all-forward/all-backward (GPipe) schedule over blocking gloo send/recv.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from tgruntime.trainer.batch import LMBatch

__all__ = [
    "ForwardBackwardFunc",
    "finalize_grads_local",
    "local_forward_backward",
    "select_forward_backward",
]

ForwardBackwardFunc = Callable[..., list[dict[str, torch.Tensor]]]


def _scaled_loss(
    loss_func: Callable[[torch.Tensor], Any], output: torch.Tensor, num_microbatches: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    outputs = loss_func(output)
    # Same scaling as megatron's forward_step_calc_loss with calculate_per_token_loss=False:
    # a 3-tuple (sum, tokens, reported) is divided by its tokens, a 2-tuple is taken as is;
    # both by the number of micro-batches.
    if len(outputs) == 3:
        loss_sum, num_tokens, reported = outputs
        return loss_sum / torch.clamp(num_tokens, min=1) / num_microbatches, reported
    loss, reported = outputs
    return loss / num_microbatches, reported


def local_forward_backward(
    *,
    forward_step_func: Callable[..., Any],
    data_iterator: Iterator[LMBatch],
    model: torch.nn.Module | list[torch.nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool = False,
    **_: Any,
) -> list[dict[str, torch.Tensor]]:
    """CPU stand-in for megatron's schedules (same signature subset and result)."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError("virtual pipeline stages (model chunks) are not supported on CPU")
        model = model[0]
    config = get_model_config(model)
    set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
    first = parallel_state.is_pipeline_first_stage()
    last = parallel_state.is_pipeline_last_stage()
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    shape = (seq_length, micro_batch_size, config.hidden_size)
    dtype = config.pipeline_dtype or config.params_dtype

    store: list[dict[str, torch.Tensor]] = []
    inputs: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor] = []
    for _i in range(num_microbatches):
        input_tensor = None
        if pipelined and not first:
            input_tensor = torch.empty(shape, dtype=dtype)
            dist.recv(input_tensor, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            input_tensor.requires_grad_(not forward_only)
        set_input_tensor([input_tensor])
        output, loss_func = forward_step_func(data_iterator, model)
        if last:
            output, reported = _scaled_loss(loss_func, output, num_microbatches)
            store.append(reported)
        else:
            dist.send(
                output.detach().contiguous(),
                dst=parallel_state.get_pipeline_model_parallel_next_rank(),
            )
        if forward_only:
            continue
        if not pipelined:
            output.backward()  # backward right away keeps only one micro-batch's activations
            continue
        inputs.append(input_tensor)
        outputs.append(output)

    for input_tensor, output in zip(inputs, outputs, strict=True):
        if last:
            torch.autograd.backward(output)
        else:
            grad = torch.empty(shape, dtype=dtype)
            dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank())
            torch.autograd.backward(output, grad_tensors=grad)
        if not first:
            assert input_tensor is not None and input_tensor.grad is not None
            dist.send(
                input_tensor.grad.contiguous(),
                dst=parallel_state.get_pipeline_model_parallel_prev_rank(),
            )

    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model])
    return store


def finalize_grads_local(model: list[torch.nn.Module], *_: Any, **__: Any) -> None:
    """CPU stand-in for megatron's ``finalize_model_grads``: average grads over data parallel;
    sum Qwen3's q/k norm grads over tensor parallel (each rank saw only its heads; megatron's
    ``_allreduce_non_tensor_model_parallel_grads``); with tied embeddings over several pipeline
    stages sum the embedding's gradient with its copy's on the last stage (megatron's
    ``_allreduce_word_embedding_grads``).

    (No sequence parallelism: nothing else needs reducing.)
    """
    _average_over_data_parallel(model)
    _sum_qk_norm_grads(model)
    _sum_tied_embedding_grads(model)


def _sum_qk_norm_grads(model: list[torch.nn.Module]) -> None:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    grads = [
        p.grad
        for chunk in model
        for name, p in chunk.named_parameters()
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name)
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    for grad, synced in zip(
        grads,
        torch._utils._unflatten_dense_tensors(flat, grads),  # type: ignore[no-untyped-call]
        strict=True,
    ):
        grad.copy_(synced)


def _sum_tied_embedding_grads(model: list[torch.nn.Module]) -> None:
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    for chunk in model:
        inner: Any = chunk
        while not hasattr(inner, "share_embeddings_and_output_weights") and hasattr(
            inner, "module"
        ):
            inner = inner.module
        if not getattr(inner, "share_embeddings_and_output_weights", False):
            continue
        weight = inner.shared_embedding_or_output_weight()
        if weight is not None and weight.grad is not None:
            dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def _average_over_data_parallel(model: list[torch.nn.Module]) -> None:
    if parallel_state.get_data_parallel_world_size() == 1:
        return
    group = parallel_state.get_data_parallel_group()
    grads = [p.grad for chunk in model for p in chunk.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]
    dist.all_reduce(flat, group=group)
    flat /= parallel_state.get_data_parallel_world_size()
    for grad, synced in zip(
        grads,
        torch._utils._unflatten_dense_tensors(flat, grads),  # type: ignore[no-untyped-call]
        strict=True,
    ):
        grad.copy_(synced)


def select_forward_backward(*, on_gpu: bool) -> ForwardBackwardFunc:
    """megatron's schedule on a GPU, the local one on a CPU."""
    return get_forward_backward_func() if on_gpu else local_forward_backward
