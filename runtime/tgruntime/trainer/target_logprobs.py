"""Log-probs of K target ids per position from tensor-parallel-sharded logits, in one pass.

``target_log_probs(logits [..., V / tp], ids [..., K])`` is ``log_softmax(logits)`` over the
whole vocabulary, gathered at ``ids``: the shard's max is all-reduced (MAX), then the sum of
``exp`` and each id's logit (held by exactly one rank, zero elsewhere) are all-reduced (SUM)
over the tensor-parallel group, so every rank holds the same ``[..., K]``. This is what
soft targets (Tinker's ``[N, K]`` ``target_tokens``, top-K distillation) need: the log-sum-exp
is computed once per position, not once per target column.

The backward is written out, as megatron's ``vocab_parallel_cross_entropy`` writes its own:
``d lp[k] / d z[j] = [j == ids[k]] - softmax(z)[j]``, so the shard's gradient is
``-sum_k(g[k]) * softmax + scatter_add(ids, g)``. Only the shard's softmax (float32, the size
of the logits) is kept for it; autograd through ``exp`` and ``gather`` would keep two such
tensors. Each rank's input gradient is its shard's; the output layer's backward sums across
the group, as it does for megatron's loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

__all__ = ["target_log_probs"]


def _tp() -> tuple[Any, int, int]:
    """The tensor-parallel group, its size and this rank's index in it (1, 0 without TP)."""
    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


class _TargetLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        group, tp, rank = _tp()
        shard = logits.shape[-1]
        z = logits.to(torch.float32, copy=True)  # float32, and never the caller's storage
        z_max = z.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group)
        z.sub_(z_max.unsqueeze(-1))
        local = ids - rank * shard
        mine = (local >= 0) & (local < shard)
        local = torch.where(mine, local, torch.zeros_like(local))
        picked = z.gather(-1, local) * mine  # the targets' shifted logits this shard holds
        z.exp_()
        sum_exp = z.sum(dim=-1)
        if tp > 1:
            both = torch.cat([picked, sum_exp.unsqueeze(-1)], dim=-1)
            dist.all_reduce(both, group=group)
            picked, sum_exp = both[..., :-1], both[..., -1]
        z.div_(sum_exp.unsqueeze(-1))  # the shard's softmax, kept for the backward
        ctx.save_for_backward(z, local, mine)
        ctx.in_dtype = logits.dtype
        return picked - torch.log(sum_exp).unsqueeze(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, local, mine = ctx.saved_tensors
        g = grad.float()
        out = softmax.mul_(-g.sum(dim=-1, keepdim=True))  # in place: the backward runs once
        out.scatter_add_(-1, local, g * mine)
        return out.to(ctx.in_dtype), None


def target_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the whole vocabulary at ``ids``: float32 ``[..., K]`` for logits
    ``[..., V / tp]`` (this rank's vocabulary shard) and int64 ids ``[..., K]`` in ``[0, V)``."""
    if logits.shape[:-1] != ids.shape[:-1]:
        raise ValueError(
            f"target_log_probs: logits {tuple(logits.shape)} and ids {tuple(ids.shape)} differ "
            "before their last dimension"
        )
    out: torch.Tensor = _TargetLogProbs.apply(logits, ids.to(torch.int64))
    return out
