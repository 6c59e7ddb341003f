"""RoPE at each row's own position: the one rotation both decode paths use."""

from __future__ import annotations

import torch

__all__ = ["rotate"]


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE over the whole head dim: megatron's unfused arithmetic
    (``t * cos + rotate_half(t) * sin``) with cos/sin computed once per step."""
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin
