"""The tagged output lines of the runtime's entrypoints, and their parsers (one definition).

Each line is ``TAG {json}`` on stdout: the server prints :data:`GROUP_READY` (or
:data:`GROUP_FAILED`), the teardown :data:`TEARDOWN`, the client one :data:`STEP` per step.
The runtime formats them with :func:`line`; the operator, ``tgctl`` and the tests read them
with :func:`parse_last` / :func:`parse_all`. Payload keys are camelCase on the wire (as in the
TrainerGroup's status) and snake_case fields here; docs/contracts.md lists them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar

GROUP_READY = "TG_GROUP_READY"
GROUP_FAILED = "TG_GROUP_FAILED"
TEARDOWN = "TG_TEARDOWN"
STEP = "TG_STEP"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupReady:
    """``TG_GROUP_READY``: the group the server created (what the operator publishes)."""

    TAG: ClassVar[str] = GROUP_READY
    group_name: str
    ray_namespace: str
    generation: int
    worker_names: tuple[str, ...]
    world_size: int
    mesh: Mapping[str, int]
    worker_class: str = ""
    use_gpu: bool | None = None
    """``workers.useGpu`` as resolved ("auto" decided against the cluster's GPUs)."""
    device: str = ""
    """What the ranks run on: "cuda", "cpu" or "mixed" ("" when the worker reports nothing)."""
    backend: str = ""
    dtype: str = ""
    resumed_from: str | None = None
    """The checkpoint every rank resumed from ("mixed" if they disagree); None: fresh weights."""
    resumed_step: int | None = None
    """The optimizer step the ranks start from (-1 if they disagree); None: fresh weights."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupFailed:
    """``TG_GROUP_FAILED``: why the server could not create the group."""

    TAG: ClassVar[str] = GROUP_FAILED
    error: str
    kind: str = ""
    """The exception's class name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Teardown:
    """``TG_TEARDOWN``: what the teardown found and removed."""

    TAG: ClassVar[str] = TEARDOWN
    group_name: str
    ray_namespace: str
    actors_killed: tuple[str, ...] = ()
    placement_groups_removed: tuple[str, ...] = ()
    keys_removed: tuple[str, ...] = ()
    complete: bool = False
    """Every actor found was killed and is gone, every placement group removed."""
    errors: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    """What was looked at, in words."""
    not_checked: tuple[str, ...] = ()
    """What could not be looked at, and why."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """``TG_STEP``: one training step as the client saw it."""

    TAG: ClassVar[str] = STEP
    step: int
    loss: float
    grad_norm: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    tp_losses: tuple[float, ...] = ()
    optimizer_step: int = -1
    """The workers' optimizer step after this one (it continues across a resume); -1: unknown."""


class _Payload(Protocol):
    TAG: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]


P = TypeVar("P", bound=_Payload)


def wire_key(field_name: str) -> str:
    """snake_case field -> camelCase key (``step_time_s`` -> ``stepTimeS``)."""
    head, *rest = field_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def payload_to_wire(payload: _Payload) -> dict[str, Any]:
    """The JSON object of a payload (camelCase keys; tuples as lists).

    Not ``tgapi.to_wire`` (the spec's wire form, ``tgapi.wire``): a payload's fields are
    plain snake_case names turned camelCase by :func:`wire_key`, with no field metadata.
    """
    out: dict[str, Any] = {}
    for f in dataclasses.fields(payload):
        value = getattr(payload, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[wire_key(f.name)] = value
    return out


def line(payload: _Payload) -> str:
    """``TAG {json}``, the one line an entrypoint prints."""
    return f"{payload.TAG} {json.dumps(payload_to_wire(payload), sort_keys=True)}"


def payload_from_wire(cls: type[P], data: Mapping[str, Any]) -> P:
    """A payload from its JSON object; ValueError naming the key when one is missing/wrong."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = wire_key(f.name)
        if key not in data:
            if f.default is dataclasses.MISSING:
                raise ValueError(f"{cls.TAG}: key {key!r} is missing")
            continue
        value = data[key]
        kind = str(f.type)
        if kind.startswith("tuple"):
            if not isinstance(value, list | tuple):
                raise ValueError(f"{cls.TAG}: {key!r} must be a list, got {value!r}")
            value = tuple(value)
        elif kind.startswith("Mapping"):
            if not isinstance(value, Mapping):
                raise ValueError(f"{cls.TAG}: {key!r} must be an object, got {value!r}")
            value = dict(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _lines(cls: type[P], text: str) -> list[P | None]:
    pattern = re.compile(rf"^\s*{re.escape(cls.TAG)} (\{{.*\}})\s*$")
    found: list[P | None] = []
    for raw in text.splitlines():
        m = pattern.match(raw)
        if m is None:
            continue
        try:
            data = json.loads(m.group(1))
            found.append(payload_from_wire(cls, data) if isinstance(data, dict) else None)
        except ValueError:
            found.append(None)  # a broken line: it counts as the last one, and reads as None
    return found


def parse_last(cls: type[P], text: str) -> P | None:
    """The payload of the last ``TAG {json}`` line in ``text`` (e.g. a Ray job's log).

    None when there is none, or when the last one is not valid JSON of that shape.
    """
    found = _lines(cls, text)
    return found[-1] if found else None


def parse_all(cls: type[P], text: str) -> list[P]:
    """Every well-formed ``TAG {json}`` line's payload, in order (e.g. the client's steps)."""
    return [p for p in _lines(cls, text) if p is not None]
