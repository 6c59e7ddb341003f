"""Choosing the next token with sampling settings per row (continuous batching).

The one-shot path (``select.py``) applies one request's settings to the whole batch. Here
each row carries its own temperature, top-k, top-p, noise key and step, as device tensors
``[R]``, so requests with different settings decode in one step and the step is a fixed
graph whatever the settings. For every row the arithmetic is the one ``select.next_token``
does for that row alone (the same division, the same k-th value, the same nucleus), so a row
gets the tokens it would get in a one-shot call of its own request.
"""

from __future__ import annotations

import dataclasses

import torch

from tgruntime.trainer.sampling.draw import draw

__all__ = ["RowSettings", "next_token_rows"]


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per-row device tensors ``[R]`` (views of the engine's slot buffers)."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_k: torch.Tensor  # int64; the vocabulary size = off
    top_p: torch.Tensor  # float32; 1 = off
    keys: torch.Tensor  # int64 noise keys
    step: torch.Tensor  # int64: index of the token this step chooses, per row

    def narrow(self, rows: int) -> RowSettings:
        return RowSettings(
            *(t[:rows] for t in (self.temperature, self.top_k, self.top_p, self.keys, self.step))
        )


def filter_rows(
    logits: torch.Tensor, rows: RowSettings, *, top_k: bool, top_p: bool
) -> torch.Tensor:
    """``logits / temperature`` per row, tokens outside the row's top-k / nucleus at -inf.

    ``top_k`` / ``top_p``: whether any row uses the filter (False skips its sort)."""
    safe = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    z = logits / safe.to(logits.dtype).unsqueeze(1)
    vocab = z.shape[-1]
    if top_k:
        k = rows.top_k.clamp(1, vocab)
        ordered = torch.sort(z, dim=-1, descending=True).values
        kth = ordered.gather(-1, (k - 1).unsqueeze(1))
        z = z.masked_fill(z < kth, float("-inf"))  # k = vocab: kth is the least, none dropped
    if top_p:
        ordered, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        p = rows.top_p.to(probs.dtype).unsqueeze(1)
        drop = (before >= p) & (p < 1.0)  # top_p = 1: rounding must not drop the tail
        ordered = ordered.masked_fill(drop, float("-inf"))
        z = torch.empty_like(z).scatter_(-1, order, ordered)
    return z


def next_token_rows(
    logits: torch.Tensor, rows: RowSettings, *, top_k: bool = True, top_p: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ``[R]`` int64, its model log-prob ``[R]`` fp32) from fp32 logits ``[R, V]``."""
    z = filter_rows(logits, rows, top_k=top_k, top_p=top_p) if top_k or top_p else None
    return draw(logits, z, rows.temperature, rows.keys, rows.step)
