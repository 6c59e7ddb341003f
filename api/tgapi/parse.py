"""Parse TrainerGroup YAML/dicts into the typed model.

``parse_spec`` converts the wire form field by field (``wire.from_wire``: types, enums,
bounds, unknown keys) and then runs the cross-field rules in ``validation.py`` and the
size estimate in ``sizing.py``; all problems are collected into one
:class:`~tgapi.errors.SpecErrors` so a user sees every mistake at once. The way back
(model to wire form) is ``wire.to_wire``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tgapi.errors import SpecError, SpecErrors
from tgapi.model import API_GROUP, API_VERSION, KIND, TrainerGroup, TrainerGroupSpec
from tgapi.pretrained import apply_pretrained
from tgapi.sizing import sizing_errors
from tgapi.validation import cross_field_errors
from tgapi.wire import _short, from_wire

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def parse_spec(
    data: Mapping[str, Any] | None, *, path: str = "spec", local: bool = False
) -> TrainerGroupSpec:
    """Parse and validate a ``spec`` mapping.

    ``local=True`` is tgctl's and the runtime's mode: no Kubernetes, so the
    rayCluster/rayClusterRef choice is not required, and the files are at hand, so
    ``model.pretrained``'s config.json gives the model's shape (``tgapi.pretrained``).
    """
    spec, errors = from_wire(TrainerGroupSpec, {} if data is None else data, path=path)
    if spec is not None and local and spec.model.pretrained is not None:
        # With the files at hand, the checkpoint's config.json gives the model's shape.
        written = data.get("model") if isinstance(data, Mapping) else None
        spec, pretrained_errors = apply_pretrained(spec, written=written, path=path)
        errors.extend(pretrained_errors)
    if spec is not None:
        errors.extend(cross_field_errors(spec, path=path, local=local))
        errors.extend(sizing_errors(spec, path=path, local=local))
    if errors:
        raise SpecErrors(errors)
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
