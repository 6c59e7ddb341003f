"""How many rows one micro-batch holds: the token budget (``spec.training.microBatchTokens``).

A ``forward_backward`` or log-prob call of any size is split into micro-batches of at most
``budget`` tokens (rows x padded length), run one after another (each one's activations are
freed by its backward before the next), and their summed losses and gradients are the whole
call's: the loss functions are sums over tokens (token_steps.py).

Without pipelining (:func:`plan_by_length`) the rows are taken longest first and each
micro-batch is cut to its own longest row (rounded up to ``WIDTH_QUANTUM`` tokens), so a call of
mixed lengths does not compute the padding of its longest row on every row. With pipelining
(:func:`plan_micro_batches`) every micro-batch has the same shape (megatron's p2p buffers): the
call's padded length, and the largest divisor of the local batch within the budget.

Budget 0 in the spec: chosen when the group starts from the GPU's free memory (after the
weights and optimizer state are placed) and an estimate of the activation bytes per token
(:func:`activation_bytes_per_token`); no limit on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tgapi.errors import PicklableError

__all__ = [
    "WIDTH_QUANTUM",
    "LengthPlan",
    "MicroPlan",
    "TokenBudgetError",
    "activation_bytes_per_token",
    "auto_budget",
    "plan_by_length",
    "plan_micro_batches",
]

# The share of free GPU memory one micro-batch's activations may take (the rest: allocator
# fragmentation, NCCL buffers, the sampler's KV cache and CUDA graphs).
FREE_SHARE = 0.4
MIN_AUTO, MAX_AUTO = 1024, 1 << 20
# Micro-batch widths are rounded up to a multiple of this: fewer distinct shapes for the
# kernels' tile sizes and for megatron's compiled fusions, at most 15 padded tokens a row.
WIDTH_QUANTUM = 16


class TokenBudgetError(PicklableError, ValueError):
    """One row is longer than a micro-batch may be."""


@dataclass(frozen=True)
class MicroPlan:
    bounds: tuple[tuple[int, int], ...]  # [start, stop) rows of each micro-batch
    micro_batch_size: int  # rows of the full micro-batches


def plan_micro_batches(
    *, rows: int, seq_length: int, pp: int, micro_batch_size: int, budget: int, source: str
) -> MicroPlan:
    """Split ``rows`` rows of ``seq_length`` tokens; ``micro_batch_size`` is what the call
    would use without a budget (0 or less: no budget)."""
    size = max(1, micro_batch_size)
    if budget > 0:
        if seq_length > budget:
            raise TokenBudgetError(
                f"a row of {seq_length} tokens (the call's longest, padded) does not fit one "
                f"micro-batch of {budget} tokens ({source}): raise "
                "spec.training.microBatchTokens, or send shorter sequences"
            )
        cap = budget // seq_length
        if size > cap:
            size = cap if pp == 1 else _largest_divisor_at_most(rows, cap)
    if pp > 1 and rows % size:
        raise ValueError(f"local batch {rows} is not divisible by micro-batch size {size}")
    bounds = tuple((i, min(i + size, rows)) for i in range(0, rows, size))
    return MicroPlan(bounds=bounds, micro_batch_size=size)


@dataclass(frozen=True)
class LengthPlan:
    order: tuple[int, ...]  # the call's rows, longest first (ties in request order)
    groups: tuple[tuple[int, int, int], ...]  # [start, stop) into ``order``, and the width
    micro_batch_size: int  # rows of the largest micro-batch


def plan_by_length(
    *,
    lengths: Sequence[int],
    seq_length: int,
    micro_batch_size: int,
    budget: int,
    source: str,
    quantum: int = WIDTH_QUANTUM,
) -> LengthPlan:
    """Micro-batches without pipelining: rows longest first, each micro-batch as wide as its
    first row (its length rounded up to ``quantum``, at most ``seq_length``) and holding at most
    ``micro_batch_size`` rows and ``budget`` tokens (0 or less: no budget)."""
    order = tuple(sorted(range(len(lengths)), key=lambda i: -lengths[i]))
    if budget > 0 and order and lengths[order[0]] > budget:
        raise TokenBudgetError(
            f"a row of {lengths[order[0]]} tokens (the call's longest) does not fit one "
            f"micro-batch of {budget} tokens ({source}): raise "
            "spec.training.microBatchTokens, or send shorter sequences"
        )
    groups: list[tuple[int, int, int]] = []
    start = 0
    while start < len(order):
        length = lengths[order[start]]
        width = min(seq_length, -(-max(1, length) // quantum) * quantum)
        if budget > 0 and width > budget:
            width = length  # the rounding alone would overflow the budget
        cap = max(1, micro_batch_size)
        if budget > 0:
            cap = min(cap, max(1, budget // width))
        stop = min(len(order), start + cap)
        groups.append((start, stop, width))
        start = stop
    size = max((b - a for a, b, _ in groups), default=1)
    return LengthPlan(order=order, groups=tuple(groups), micro_batch_size=size)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1


def activation_bytes_per_token(
    *, hidden: int, layers_local: int, vocab: int, tp: int, element_bytes: int
) -> int:
    """A generous estimate of one token's training activations on one rank: per transformer
    layer ~17 hidden-sized values kept for backward (megatron's 34 bytes per hidden unit in
    16-bit, attention without the s^2 term: SDPA/flash), and the logits in the call's dtype
    plus three fp32 copies for the vocab-parallel cross-entropy and its gradient."""
    per_layer = 17 * hidden * element_bytes
    logits = (vocab // max(1, tp)) * (element_bytes + 12)
    return layers_local * per_layer + logits


def auto_budget(*, free_bytes: int, per_token: int) -> int:
    """Tokens per micro-batch from free memory (FREE_SHARE of it), within [MIN_AUTO, MAX_AUTO]."""
    tokens = int(FREE_SHARE * free_bytes) // max(1, per_token)
    return max(MIN_AUTO, min(MAX_AUTO, tokens))
