"""Choosing the next token from full-vocabulary logits: temperature, top-k, top-p, Gumbel-max.

All tensor ops with static shapes and no host synchronisation, so a decode step including
the choice can be captured in a CUDA graph. The reported log-prob is the model's own
(``log_softmax`` of the raw logits: temperature 1, no filtering), the value
``compute_log_prob`` gives for the same sequence.
"""

from __future__ import annotations

import torch

from tgruntime.trainer.sampling.draw import draw
from tgruntime.trainer.sampling.params import SamplingParams

__all__ = ["filter_logits", "next_token"]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits / temperature`` with tokens outside top-k / the top-p nucleus at -inf."""
    # a device tensor, not a Python scalar: CUDA divides by a host scalar as a multiplication
    # by its reciprocal, and the per-row path (``filter_rows``) divides by a tensor; both must
    # give the same bits. ``new_full`` is a fill kernel (no host copy: capturable in a graph)
    z = logits / logits.new_full((1,), params.temperature)
    vocab = z.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        drop = before >= params.top_p  # the best token is always kept (before = 0)
        ordered = ordered.masked_fill(drop, float("-inf"))
        z = torch.empty_like(z).scatter_(-1, order, ordered)
    return z


def next_token(
    logits: torch.Tensor, keys: torch.Tensor, step: torch.Tensor | int, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ``[R]`` int64, its model log-prob ``[R]`` fp32) from fp32 logits ``[R, V]``."""
    if params.temperature == 0.0:
        token = logits.argmax(dim=-1)
        logprob = torch.log_softmax(logits, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
        return token, logprob
    filtered = 0 < params.top_k < logits.shape[-1] or params.top_p < 1.0
    z = filter_logits(logits, params) if filtered else None
    return draw(logits, z, logits.new_full((1,), params.temperature), keys, step)
