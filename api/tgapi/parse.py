"""Parse TrainerGroup YAML/dicts into the typed model, and back.

``parse_spec`` checks types, enums, bounds and unknown keys field by field and then
runs the cross-field rules in ``validation.py``; all problems are collected into one
:class:`~tgapi.errors.SpecErrors` so a user sees every mistake at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tgapi.errors import SpecError, SpecErrors
from tgapi.fields import default_value, field_meta, has_default
from tgapi.model import (
    API_GROUP,
    API_VERSION,
    KIND,
    USE_GPU_AUTO,
    TrainerGroup,
    TrainerGroupSpec,
)

T = TypeVar("T")
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


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


def parse_spec(
    data: Mapping[str, Any] | None, *, path: str = "spec", local: bool = False
) -> TrainerGroupSpec:
    """Parse and validate a ``spec`` mapping.

    ``local=True`` is tgctl's and the runtime's mode: no Kubernetes, so the
    rayCluster/rayClusterRef choice is not required, and the files are at hand, so
    ``model.pretrained``'s config.json gives the model's shape (``tgapi.pretrained``).
    """
    from tgapi.pretrained import apply_pretrained
    from tgapi.sizing import sizing_errors
    from tgapi.validation import cross_field_errors

    parser = _Parser()
    spec = parser.parse_dataclass(TrainerGroupSpec, {} if data is None else data, path)
    if spec is not None and local and spec.model.pretrained is not None:
        # With the files at hand, the checkpoint's config.json gives the model's shape.
        written = data.get("model") if isinstance(data, Mapping) else None
        spec, pretrained_errors = apply_pretrained(spec, written=written, path=path)
        parser.errors.extend(pretrained_errors)
    if spec is not None:
        parser.errors.extend(cross_field_errors(spec, path=path, local=local))
        parser.errors.extend(sizing_errors(spec, path=path, local=local))
    if parser.errors:
        raise SpecErrors(parser.errors)
    assert spec is not None
    return spec


def parse_resource(body: Mapping[str, Any], *, local: bool = False) -> TrainerGroup:
    """Parse a whole TrainerGroup object (``apiVersion``, ``kind``, ``metadata``, ``spec``)."""
    errors: list[SpecError] = []
    if not isinstance(body, Mapping):
        raise SpecErrors(
            [
                SpecError(
                    field="(document)",
                    problem="not a mapping",
                    fix="write a TrainerGroup YAML object",
                )
            ]
        )
    api_version = body.get("apiVersion")
    if api_version != f"{API_GROUP}/{API_VERSION}":
        errors.append(
            SpecError(
                field="apiVersion",
                problem=f"{_short(api_version)} is not supported",
                fix=f"use {API_GROUP}/{API_VERSION}",
            )
        )
    if body.get("kind") != KIND:
        errors.append(
            SpecError(
                field="kind",
                problem=f"{_short(body.get('kind'))} is not {KIND}",
                fix=f"use kind: {KIND}",
            )
        )
    meta = body.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > 53:
        errors.append(
            SpecError(
                field="metadata.name",
                problem=f"{_short(name)} is not a valid name",
                fix="use lowercase letters, digits and '-', at most 53 characters",
            )
        )
    namespace = (meta.get("namespace") if isinstance(meta, Mapping) else None) or "default"
    if not isinstance(namespace, str) or not _NAME_RE.match(namespace) or len(namespace) > 63:
        errors.append(
            SpecError(
                field="metadata.namespace",
                problem=f"{_short(namespace)} is not a valid namespace",
                fix="use lowercase letters, digits and '-', at most 63 characters",
            )
        )
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    if labels is not None and not (
        isinstance(labels, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        errors.append(
            SpecError(
                field="metadata.labels",
                problem="must map strings to strings",
                fix='write labels as key: "value" pairs (quote numbers and booleans)',
            )
        )
    try:
        spec = parse_spec(body.get("spec"), local=local)
    except SpecErrors as exc:
        errors.extend(exc.errors)
        spec = None
    if errors:
        raise SpecErrors(errors)
    assert spec is not None and isinstance(name, str) and isinstance(meta, Mapping)
    generation = meta.get("generation")
    return TrainerGroup(
        name=name,
        namespace=str(namespace),
        spec=spec,
        uid=str(meta.get("uid") or ""),
        # Set by the API server; a file may carry anything here, and nothing depends on it.
        generation=generation if type(generation) is int and generation >= 0 else 0,
        labels=dict(labels or {}),
    )


def load_file(path: str | Path, *, local: bool = False) -> TrainerGroup:
    """Read a YAML file holding one TrainerGroup (the first TrainerGroup document wins)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecErrors(
            [
                SpecError(
                    field=str(p),
                    problem=f"is not UTF-8 text (byte {exc.start})",
                    fix="pass a TrainerGroup YAML file saved as UTF-8",
                )
            ]
        ) from exc
    except OSError as exc:
        raise SpecErrors(
            [
                SpecError(
                    field=str(p),
                    problem=f"cannot read the file ({exc.strerror})",
                    fix="check the path passed with -f",
                )
            ]
        ) from exc
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecErrors(
            [
                SpecError(
                    field=str(p),
                    problem=f"is not valid YAML{where}: {getattr(exc, 'problem', exc)}",
                    fix="fix the YAML syntax (indentation, colons, quotes)",
                )
            ]
        ) from exc
    except (ValueError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise these for values it parses but cannot build: an
        # integer over Python's 4300-digit limit, a date such as 2024-02-30, deep nesting.
        raise SpecErrors(
            [
                SpecError(
                    field=str(p),
                    problem=f"holds a value YAML cannot build: {_short(str(exc), 200)}",
                    fix="fix or quote that value (dates, very long numbers) or flatten the nesting",
                )
            ]
        ) from exc
    for doc in docs:
        if isinstance(doc, Mapping) and doc.get("kind") == KIND:
            try:
                return parse_resource(doc, local=local)
            except RecursionError as exc:
                raise SpecErrors(
                    [
                        SpecError(
                            field=str(p),
                            problem="is nested too deeply",
                            fix="write the TrainerGroup as a plain YAML mapping",
                        )
                    ]
                ) from exc
    raise SpecErrors(
        [
            SpecError(
                field=str(p),
                problem=f"holds no document with kind: {KIND}",
                fix="pass a TrainerGroup manifest (see manifests/examples/)",
            )
        ]
    )


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
