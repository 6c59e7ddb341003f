"""How many rows one micro-batch holds: the token budget (``spec.training.microBatchTokens``).

A ``forward_backward`` or log-prob call of any size is split into micro-batches of at most
``budget`` tokens (rows x padded length), run one after another (each one's activations are
freed by its backward before the next), and their summed losses and gradients are the whole
call's: the loss functions are sums over tokens (token_steps.py). Without pipelining the last
micro-batch may be shorter; with it, every micro-batch has the same size (megatron's p2p
shapes), the largest divisor of the local batch within the budget.

Budget 0 in the spec: chosen when the group starts from the GPU's free memory (after the
weights and optimizer state are placed) and an estimate of the activation bytes per token
(:func:`activation_bytes_per_token`); no limit on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from tgapi.errors import PicklableError

__all__ = [
    "MicroPlan",
    "TokenBudgetError",
    "activation_bytes_per_token",
    "auto_budget",
    "plan_micro_batches",
]

# The share of free GPU memory one micro-batch's activations may take (the rest: allocator
# fragmentation, NCCL buffers, the sampler's KV cache and CUDA graphs).
FREE_SHARE = 0.4
MIN_AUTO, MAX_AUTO = 1024, 1 << 20


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
