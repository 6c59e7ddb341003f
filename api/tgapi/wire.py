"""The spec's wire form (camelCase mappings, as under a TrainerGroup's ``.spec``) and back.

Two conversions and nothing else:

* :func:`to_wire`: a model value (``TrainerGroupSpec`` or any part of it) to its camelCase
  wire form, defaults included; the CRD's CEL, ``tgapi.rules`` and the workers' init payload
  all read this form;
* :func:`from_wire`: a wire mapping to the typed model, field by field (types, enums,
  bounds, patterns, unknown keys), every problem collected as a :class:`SpecError`.

No cross-field rules here: ``tgapi.parse`` runs those (``validation``, ``sizing``) after
:func:`from_wire`, and they call :func:`to_wire`, so this module imports neither of them
(nor ``parse``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from tgapi.errors import SpecError
from tgapi.fields import default_value, field_meta, has_default
from tgapi.model import USE_GPU_AUTO

__all__ = ["from_wire", "to_wire"]

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


class _Parser:
    def __init__(self) -> None:
        self.errors: list[SpecError] = []

    def fail(self, path: str, problem: str, fix: str) -> None:
        self.errors.append(SpecError(field=path, problem=problem, fix=fix))

    def parse_dataclass(self, cls: type[T], data: Any, path: str) -> T | None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            self.fail(
                path,
                f"expected a mapping, got {type(data).__name__}",
                "write it as key: value pairs",
            )
            return None
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        by_wire = {field_meta(f).name: f for f in fields}
        for key in data:
            if key not in by_wire:
                key = key if isinstance(key, str) else _short(key)
                close = difflib.get_close_matches(key, list(by_wire), n=1)
                hint = (
                    f"did you mean {close[0]!r}?"
                    if close
                    else f"allowed keys: {', '.join(sorted(by_wire))}"
                )
                self.fail(f"{path}.{key}", "unknown field", f"remove it or rename it ({hint})")
        values: dict[str, Any] = {}
        ok = True
        for f in fields:
            meta = field_meta(f)
            fpath = f"{path}.{meta.name}"
            if meta.name not in data or data[meta.name] is None:
                if has_default(f):
                    values[f.name] = default_value(f)
                else:
                    self.fail(fpath, "is required", f"set {meta.name}")
                    ok = False
                continue
            value = self.parse_value(hints[f.name], data[meta.name], fpath, f)
            if value is _INVALID:
                ok = False
            else:
                values[f.name] = value
        if not ok:
            return None
        return cls(**values)

    def parse_value(self, tp: Any, raw: Any, path: str, f: dataclasses.Field[Any] | None) -> Any:
        if f is not None and field_meta(f).bool_or_auto:
            return self.parse_bool_or_auto(raw, path)
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            inner = [a for a in args if a is not type(None)]
            return self.parse_value(inner[0], raw, path, f)
        if dataclasses.is_dataclass(tp):
            parsed = self.parse_dataclass(tp, raw, path)  # type: ignore[arg-type]
            return _INVALID if parsed is None else parsed
        if origin is list:
            if not isinstance(raw, list):
                self.fail(
                    path, f"expected a list, got {type(raw).__name__}", "write it as a YAML list"
                )
                return _INVALID
            items = [
                self.parse_value(args[0], item, f"{path}[{i}]", f) for i, item in enumerate(raw)
            ]
            return _INVALID if any(i is _INVALID for i in items) else items
        if origin is dict:
            if not isinstance(raw, Mapping):
                self.fail(
                    path,
                    f"expected a mapping, got {type(raw).__name__}",
                    "write it as key: value pairs",
                )
                return _INVALID
            if args and args[1] is str:
                bad = [k for k, v in raw.items() if not isinstance(v, str)]
                if bad:
                    self.fail(f"{path}.{bad[0]}", "expected a string value", "quote the value")
                    return _INVALID
            return dict(raw)
        return self.parse_scalar(tp, raw, path, f)

    def parse_bool_or_auto(self, raw: Any, path: str) -> Any:
        if isinstance(raw, bool) or raw == USE_GPU_AUTO:
            return raw
        self.fail(
            path,
            f'expected true, false or "{USE_GPU_AUTO}", got {_short(raw)}',
            f'use true, false or "{USE_GPU_AUTO}" (GPUs when the Ray cluster has them)',
        )
        return _INVALID

    def parse_scalar(self, tp: Any, raw: Any, path: str, f: dataclasses.Field[Any] | None) -> Any:
        if tp is bool:
            if not isinstance(raw, bool):
                self.fail(path, f"expected true or false, got {_short(raw)}", "use true or false")
                return _INVALID
            value: Any = raw
        elif tp is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                self.fail(path, f"expected an integer, got {_short(raw)}", "write a whole number")
                return _INVALID
            value = raw
        elif tp is float:
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                self.fail(
                    path, f"expected a number, got {_short(raw)}", "write a number such as 1e-4"
                )
                return _INVALID
            value = float(raw) if isinstance(raw, float) or abs(raw) < 2**63 else math.inf
            if not math.isfinite(value):
                self.fail(
                    path, f"{_short(raw)} is not a finite number", "write a number such as 1e-4"
                )
                return _INVALID
        elif tp is str:
            if not isinstance(raw, str):
                self.fail(path, f"expected a string, got {_short(raw)}", "quote the value")
                return _INVALID
            value = raw
        elif tp is Any:
            return raw
        else:  # pragma: no cover - a model bug, not a user error
            raise TypeError(f"unsupported field type {_type_name(tp)} at {path}")
        if f is None:
            return value
        meta = field_meta(f)
        if meta.enum is not None and value not in meta.enum:
            close = difflib.get_close_matches(str(value), list(meta.enum), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self.fail(
                path, f"{_short(value)} is not allowed", f"use one of {', '.join(meta.enum)}{hint}"
            )
            return _INVALID
        if meta.minimum is not None and isinstance(value, int | float):
            too_small = value <= meta.minimum if meta.exclusive_minimum else value < meta.minimum
            if too_small:
                bound = (
                    f"> {_num(meta.minimum)}"
                    if meta.exclusive_minimum
                    else f">= {_num(meta.minimum)}"
                )
                self.fail(path, f"{_short(value)} is too small", f"use a value {bound}")
                return _INVALID
        if meta.maximum is not None and isinstance(value, int | float) and value > meta.maximum:
            self.fail(path, f"{_short(value)} is too large", f"use a value <= {_num(meta.maximum)}")
            return _INVALID
        if (
            meta.pattern is not None
            and isinstance(value, str)
            and not _full_match(meta.pattern, value)
        ):
            self.fail(
                path, f"{_short(value)} has the wrong format", f"match the pattern {meta.pattern}"
            )
            return _INVALID
        if meta.max_length is not None and isinstance(value, str) and len(value) > meta.max_length:
            self.fail(path, f"is {len(value)} characters long", f"use at most {meta.max_length}")
            return _INVALID
        return value


def _full_match(pattern: str, value: str) -> bool:
    # Python's "$" also matches before a final newline; the API server's (RE2) does not.
    m = re.match(pattern, value)
    return m is not None and m.end() == len(value)


def _short(raw: Any, limit: int = 60) -> str:
    """``repr(raw)`` cut to ``limit`` characters (a 10,000-digit number stays readable)."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw.bit_length() > 3 * limit:
        return f"a {raw.bit_length()}-bit integer"
    text = repr(raw)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _num(x: float) -> str:
    """A bound as written in the model: 65536, not 65536.0 or 6.5536e+04."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class _Invalid:
    pass


_INVALID: Any = _Invalid()


def to_wire(value: Any) -> Any:
    """Serialise a model value to its camelCase wire form (defaults included)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if v is None:
                continue
            out[field_meta(f).name] = to_wire(v)
        return out
    if isinstance(value, list):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(cls: type[T], data: Any, *, path: str) -> tuple[T | None, list[SpecError]]:
    """``data`` (a wire mapping) as a ``cls`` dataclass, and the problems found at ``path``.

    The value is None when a field could not be converted; the errors name every problem
    (unknown keys too, which do not make the value None). No cross-field rules.
    """
    parser = _Parser()
    value = parser.parse_dataclass(cls, data, path)
    return value, parser.errors
