"""Kubernetes Events for phase changes and failures.

The reconcile flow reports through an :class:`EventSink`; in the operator that is
:class:`KopfEvents`, which posts with ``kopf.event`` (so events show in
``kubectl describe trainergroup``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import kopf

WARNING_PHASES = frozenset({"Degraded", "Failed"})


class EventSink(Protocol):
    def post(self, *, type: str, reason: str, message: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class KopfEvents:
    """Posts events about one object through kopf's event queue."""

    body: Mapping[str, Any]

    def post(self, *, type: str, reason: str, message: str) -> None:
        kopf.event(dict(self.body), type=type, reason=reason, message=message[:1000])  # type: ignore[arg-type]


def phase_changed(sink: EventSink, *, old: str, new: str, message: str) -> None:
    if old == new:
        return
    type_ = "Warning" if new in WARNING_PHASES else "Normal"
    sink.post(type=type_, reason=new, message=f"{old or 'New'} -> {new}: {message}")


def warn(sink: EventSink, *, reason: str, message: str) -> None:
    sink.post(type="Warning", reason=reason, message=message)


def info(sink: EventSink, *, reason: str, message: str) -> None:
    sink.post(type="Normal", reason=reason, message=message)
