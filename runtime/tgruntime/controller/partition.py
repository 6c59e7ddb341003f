"""Splitting a number of rows over parts: pure arithmetic shared by DataProto and dispatch."""

from __future__ import annotations

import math
import sys
from typing import Any


def chunk_lengths(total: int, parts: int) -> tuple[list[int], list[int]]:
    """Split ``total`` rows over ``parts`` equal slots of ceil(total/parts) rows.

    Returns (real rows per part, padding rows per part): the tail parts hold the padding,
    so after trimming each part's output the concatenation is the unpadded batch in order.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    size = math.ceil(total / parts) if total else 0
    real = [max(0, min(size, total - i * size)) for i in range(parts)]
    return real, [size - r for r in real]


def is_dataproto(value: Any) -> bool:
    """isinstance(value, DataProto) without importing torch when no DataProto exists yet."""
    module = sys.modules.get("tgruntime.controller.dataproto")
    return module is not None and isinstance(value, module.DataProto)


def is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_tensordict(value: Any) -> bool:
    """isinstance(value, TensorDict) without importing tensordict when none exists yet."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(value, module.TensorDict)
