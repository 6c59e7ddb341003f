"""The names a group call's dispatch is chosen by (shared by decorator.py and dispatch.py).

A module of its own so that dispatch.py (the table of dispatch/collect functions) and
decorator.py (``@register`` and the method specs, which bind mesh dispatch to that table)
import it, not each other.
"""

from __future__ import annotations

import enum

TRIM_KWARG = "__tg_trim__"
"""The keyword a DP_COMPUTE_PROTO_WITH_FUNC call carries to its workers (padding to trim)."""


class Dispatch(enum.Enum):
    """How a group call's arguments are spread over the workers (verl's names)."""

    RANK_ZERO = "RANK_ZERO"
    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"
    DP_COMPUTE_PROTO_WITH_FUNC = "DP_COMPUTE_PROTO_WITH_FUNC"
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"
