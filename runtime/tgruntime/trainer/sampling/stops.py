"""Where a generated sequence ends: the first stop sequence it completes, else ``max_tokens``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_stop"]


def first_stop(tokens: Sequence[int], stops: Sequence[Sequence[int]], start: int = 0) -> int | None:
    """The length of the shortest prefix of ``tokens`` that ends with a stop sequence.

    Only prefixes longer than ``start`` are looked at (a caller scanning as tokens arrive
    passes what it has already scanned). None when no stop sequence has completed.
    """
    for end in range(max(start, 0) + 1, len(tokens) + 1):
        for stop in stops:
            n = len(stop)
            if n <= end and tuple(tokens[end - n : end]) == tuple(stop):
                return end
    return None
