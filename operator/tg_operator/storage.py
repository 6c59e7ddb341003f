"""kopf's annotation storages, made total: what someone else writes there cannot wedge us.

kopf keeps each handler's progress and the last handled spec in annotations of the
TrainerGroup (``names.STORAGE_PREFIX``). Its own readers ``json.loads`` them as they are,
so a hand-edited annotation (not JSON, a JSON string, a progress record with a garbage
timestamp) raises inside kopf on every event and the object is never handled again. These
subclasses read the same keys and treat garbage as absent (a handler that never ran, a
resource seen for the first time: both re-run the idempotent reconcile), with one logged
warning per annotation key.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf

log = logging.getLogger(__name__)
_warned: set[str] = set()

_TIMES = ("started", "stopped", "delayed")
_COUNTS = ("retries",)
_FLAGS = ("success", "failure")
_TEXTS = ("message", "purpose")


def _warn_once(key: str, problem: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("ignoring annotation %s: %s (treated as absent)", key, problem)


def _decode(key: str, encoded: Any) -> Any:
    if encoded is None:
        return None
    if not isinstance(encoded, str):
        _warn_once(key, f"not a string: {type(encoded).__name__}")
        return None
    try:
        return json.loads(encoded)
    except (ValueError, RecursionError) as exc:
        _warn_once(key, f"not JSON ({exc})")
        return None


def progress_problem(record: Any) -> str | None:
    """Why ``record`` is not a progress record kopf can read, or None when it is one."""
    if not isinstance(record, Mapping):
        return f"not a JSON object: {type(record).__name__}"
    for name in _TIMES:
        value = record.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            return f"{name} is not a timestamp"
        try:
            datetime.datetime.fromisoformat(value)
        except ValueError:
            return f"{name} {value[:40]!r} is not a timestamp"
    for name in _COUNTS:
        value = record.get(name)
        if value is not None and (type(value) is not int or value < 0):
            return f"{name} is not a count"
    for name in _FLAGS:
        if record.get(name) is not None and not isinstance(record.get(name), bool):
            return f"{name} is not true/false"
    for name in _TEXTS:
        if record.get(name) is not None and not isinstance(record.get(name), str):
            return f"{name} is not text"
    subrefs = record.get("subrefs")
    if subrefs is not None and not (
        isinstance(subrefs, list) and all(isinstance(s, str) for s in subrefs)
    ):
        return "subrefs is not a list of handler ids"
    return None


class TotalProgressStorage(kopf.AnnotationsProgressStorage):
    def fetch(self, *, key: Any, body: Any) -> Any:
        annotations = _annotations(body)
        for full_key in self.make_keys(key, body=body):
            decoded = _decode(full_key, annotations.get(full_key))
            if decoded is None:
                continue
            problem = progress_problem(decoded)
            if problem is None:
                return decoded
            _warn_once(full_key, problem)
        return None


class TotalDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def fetch(self, *, body: Any) -> Any:
        annotations = _annotations(body)
        for full_key in self.make_keys(self.key, body=body):
            decoded = _decode(full_key, annotations.get(full_key))
            if decoded is None:
                continue
            if isinstance(decoded, Mapping):
                return decoded
            _warn_once(full_key, f"not a JSON object: {type(decoded).__name__}")
        return None


def _annotations(body: Any) -> Mapping[str, Any]:
    meta = body.get("metadata") if isinstance(body, Mapping) else None
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    return annotations if isinstance(annotations, Mapping) else {}
