"""A datum's provenance (SDK 0.38 ``Datum.with_provenance``): which sampled sequence each of
its positions came from.

The SDK sends two lists of runs per datum, each tiling one field in order: the runs of
``model_input`` (lengths sum to its token count) and those of ``loss_fn_inputs`` (they tile
``target_tokens``). A run is either a *prompt* run (positions ``[offset, offset + length)`` of
the prompt of the sampling request that returned ``sequence_id``) or a *sampled* run (those
positions of that sequence's sampled tokens). Nothing here knows what was sampled: the
stability store (:mod:`tgruntime.service.stability`) checks the claims against its records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from tgruntime.service.sessions import ServiceError

__all__ = ["Span", "check_tiling", "decode_spans"]

Kind = Literal["prompt", "sampled"]


@dataclass(frozen=True, kw_only=True)
class Span:
    """One run of a datum field: ``length`` positions from ``offset`` of the named sequence's
    prompt (``kind="prompt"``) or sampled tokens (``kind="sampled"``)."""

    kind: Kind
    sequence_id: str
    offset: int
    length: int


def decode_spans(messages: Iterable[Any], *, datum: int, field: str) -> tuple[Span, ...]:
    """The runs of a datum's ``model_input_spans`` / ``loss_fn_input_spans`` (protobuf
    ``ProvenanceSpan`` messages), each checked for a kind, an id and a positive length."""
    out: list[Span] = []
    for i, msg in enumerate(messages):
        kind = msg.WhichOneof("span")
        if kind not in ("prompt_tokens", "sampled_tokens"):
            raise ServiceError(
                f"datum {datum}: {field}[{i}] names neither prompt nor sampled tokens "
                "(build provenance with Datum.with_provenance)"
            )
        arm = getattr(msg, kind)
        if not arm.sequence_id or arm.length < 1 or arm.offset < 0:
            raise ServiceError(
                f"datum {datum}: {field}[{i}] needs a sequence_id, offset >= 0 and length >= 1; "
                f"got sequence_id={arm.sequence_id!r}, offset={arm.offset}, "
                f"length={arm.length}"
            )
        out.append(
            Span(
                kind="prompt" if kind == "prompt_tokens" else "sampled",
                sequence_id=str(arm.sequence_id),
                offset=int(arm.offset),
                length=int(arm.length),
            )
        )
    return tuple(out)


def check_tiling(spans: tuple[Span, ...], *, length: int, datum: int, field: str) -> None:
    """``spans`` must tile ``length`` positions exactly (the SDK's rule): the ``k``-th
    position of the field then belongs to the run that covers it, in order."""
    total = sum(s.length for s in spans)
    if total != length:
        raise ServiceError(
            f"datum {datum}: its {field} runs cover {total} positions but the field has "
            f"{length}; the runs must tile it exactly (Datum.with_provenance checks this "
            "client-side)"
        )
