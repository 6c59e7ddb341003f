"""Forward-step functions (megatron's schedule contract) for log-probs and pluggable losses.

Log-probs are ``-vocab_parallel_cross_entropy``: ``GPTModel(..., labels=)`` computes it on
the tensor-parallel-sharded logits (max, sum-exp and the target's logit all-reduced over
the TP group), so every TP rank holds the same full-vocabulary log-prob and autograd
through it is megatron's. Entropy needs the whole distribution: :func:`vocab_parallel_entropy`
all-reduces the shard's max (MAX), sum-exp and sum of ``p * z`` (SUM) over the TP group.

Soft targets (``labels`` [b, S, K], :attr:`TokenBatch.soft`): the model returns logits and
:func:`~tgruntime.trainer.target_logprobs.target_log_probs` gathers the K ids' log-probs in one
pass; the loss is ``-sum(target_weights * log_probs)`` (cross-entropy only).

A loss-function result follows megatron's 2-tuple contract ``(loss, reported)``: the
schedule divides ``loss`` by the number of micro-batches, so the step returns
``sum(weight * per_token_loss) * scale * num_microbatches`` and backpropagates exactly
``scale * sum(...)``: the engine chooses ``scale`` (docs/trainer.md, normalisation).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from tgruntime.trainer.losses import LossSpec, TokenTensors, check_loss_output
from tgruntime.trainer.target_logprobs import target_log_probs
from tgruntime.trainer.token_batch import SOFT_WEIGHTS, TokenBatch

__all__ = ["dry_run_loss", "logprob_forward_step", "loss_forward_step", "vocab_parallel_entropy"]

Reported = dict[str, torch.Tensor]


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the whole vocabulary; ``logits`` [..., V / tp]."""
    z = logits.float()
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    z_max = z.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
    shifted = z - z_max.unsqueeze(-1)
    e = shifted.exp()
    both = torch.stack([e.sum(dim=-1), (e * shifted).sum(dim=-1)])
    if tp > 1:
        dist.all_reduce(both, group=group)
    sum_exp, sum_ez = both[0], both[1]
    # H = log(sum e^s) - sum(e^s * s) / sum(e^s), with s = z - max (shift-invariant)
    return torch.log(sum_exp) - sum_ez / sum_exp


def _loss_tensors(batch: TokenBatch) -> dict[str, torch.Tensor]:
    return {**batch.extras, "loss_mask": batch.weights}


def _logprob_loss(
    batch: TokenBatch, entropy: bool, output: torch.Tensor
) -> tuple[torch.Tensor, Reported]:
    t = batch.num_targets  # S - 1, or S with target_ids
    if batch.soft:  # output: logits [b, s, V/tp]; K log-probs per position
        reported = {"log_probs": _soft_log_probs(batch, output) * batch.valid.unsqueeze(-1)}
        if entropy:
            reported["entropy"] = vocab_parallel_entropy(output[:, :t]) * batch.valid
    elif entropy:  # output: logits [b, s, V/tp]
        ent = vocab_parallel_entropy(output[:, :t])
        labels = batch.labels.transpose(0, 1).contiguous()
        # megatron's CE overwrites its input (exp, then softmax, in place): give it a copy
        # (``.contiguous()`` alone returns the same storage when the micro-batch is 1)
        logits = output.transpose(0, 1).float().clone(memory_format=torch.contiguous_format)
        log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
        log_probs = log_probs.transpose(0, 1)[:, :t]
        reported = {"log_probs": log_probs * batch.valid, "entropy": ent * batch.valid}
    else:  # output: per-token cross-entropy [b, s]
        reported = {"log_probs": -output[:, :t].float() * batch.valid}
    zero = torch.zeros((), dtype=torch.float32, device=output.device)
    return zero, {k: v.detach() for k, v in reported.items()}


def _soft_log_probs(batch: TokenBatch, logits: torch.Tensor) -> torch.Tensor:
    t = batch.num_targets
    return target_log_probs(logits[:, :t], batch.labels[:, :t])


def _model_labels(batch: TokenBatch, logits: bool) -> torch.Tensor | None:
    """What the model gets as ``labels``: None (it returns logits) for entropy and for soft
    targets, else the targets (it returns the per-token cross-entropy, megatron's fused path)."""
    return None if logits or batch.soft else batch.labels


def logprob_forward_step(
    entropy: bool,
) -> Callable[[Iterator[TokenBatch], torch.nn.Module], tuple[torch.Tensor, Any]]:
    def step(
        data_iterator: Iterator[TokenBatch], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        output = model(
            input_ids=batch.tokens,
            position_ids=batch.position_ids,
            attention_mask=None,
            labels=_model_labels(batch, entropy),
        )
        return output, functools.partial(_logprob_loss, batch, entropy)

    return step


def _pg_loss(
    batch: TokenBatch,
    spec: LossSpec,
    config: Mapping[str, Any],
    factor: float,
    output: torch.Tensor,
) -> tuple[torch.Tensor, Reported]:
    t = batch.num_targets  # S - 1, or S with target_ids
    log_probs = -output[:, :t].float()
    out = spec.fn(log_probs, TokenTensors(_loss_tensors(batch), loss=spec.name), config)
    check_loss_output(spec, out, tuple(log_probs.shape))
    per_token, metrics = out
    w = batch.weights
    weighted = per_token.float() * w
    reported: Reported = {
        "sample_loss_sum": weighted.detach().sum(dim=1),
        "sample_weight": w.sum(dim=1),
        "log_probs": log_probs.detach() * batch.valid,
    }
    w_sum = w.sum()
    for name, value in metrics.items():
        v = value.detach().float()
        total = (v * w).sum() if v.dim() == 2 else v * w_sum
        reported[f"metric/{name}"] = torch.stack([total, w_sum])
    return weighted.sum() * factor, reported


def _soft_loss(
    batch: TokenBatch, factor: float, output: torch.Tensor
) -> tuple[torch.Tensor, Reported]:
    """Cross-entropy on soft targets: ``-sum(target_weights * log_probs)`` (the weights are
    already zero where nothing is real)."""
    log_probs = _soft_log_probs(batch, output)
    weighted = -(log_probs * batch.extras[SOFT_WEIGHTS]).sum(dim=-1)
    reported: Reported = {
        "sample_loss_sum": weighted.detach().sum(dim=1),
        "sample_weight": batch.weights.sum(dim=1),
        "log_probs": log_probs.detach() * batch.valid.unsqueeze(-1),
    }
    return weighted.sum() * factor, reported


def loss_forward_step(
    *, spec: LossSpec, config: Mapping[str, Any], scale: float, num_microbatches: int
) -> Callable[[Iterator[TokenBatch], torch.nn.Module], tuple[torch.Tensor, Any]]:
    """Forward step whose backward is ``scale * sum(loss_mask * per_token_loss)``."""
    factor = scale * num_microbatches  # the schedule divides by num_microbatches

    def step(
        data_iterator: Iterator[TokenBatch], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        output = model(
            input_ids=batch.tokens,
            position_ids=batch.position_ids,
            attention_mask=None,
            labels=_model_labels(batch, False),
        )
        if batch.soft:
            return output, functools.partial(_soft_loss, batch, factor)
        return output, functools.partial(_pg_loss, batch, spec, config, factor)

    return step


@torch.no_grad()
def dry_run_loss(spec: LossSpec, config: Mapping[str, Any], batch: TokenBatch) -> None:
    """Run the loss on zero log-probs on every rank, so a bad input fails everywhere at once
    (under pipeline parallelism a failure on the last stage alone would leave its peers
    waiting in send/recv)."""
    spec.check(sorted(_loss_tensors(batch)))
    zeros = torch.zeros_like(batch.weights)
    out = spec.fn(zeros, TokenTensors(_loss_tensors(batch), loss=spec.name), config)
    check_loss_output(spec, out, tuple(zeros.shape))
