"""Split one pytest phase between tools/test.sh's two lanes, by test file, weighted by time.

``TG_SHARD=k/n`` keeps the test files of shard ``k`` (0-based) of ``n`` and deselects the rest.
The files go to shards by greedy longest-first assignment on their seconds in a measured
two-lane run, from ``tests/shard-weights.json`` (refreshed by hand): a file weighs the sum of
its selected tests' seconds (``test_s``; a test it does not name weighs their median), so a
phase that leaves some tests out (``--quick``: not flow) is split by what it runs; without
``test_s``, the file's whole seconds (``wall_s``; a file it does not name weighs their
median). ``TG_SHARD_START=a,b,...`` gives each shard the seconds its lane spends before this
phase, so the lanes end together: a number, or phases joined by ``+`` whose seconds the weights
file holds (``types+ray``; ``quick.ray``: of a ``--quick`` run). Every process that runs the same
phase with the same files, weights and start loads computes the same split: each file is in
exactly one shard (tests/tools/test_shard.py). The weights decide balance only, never which
tests run in all: a wrong or missing weight costs time, not coverage.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

WEIGHTS = Path(__file__).with_name("shard-weights.json")


def assign(
    files: Iterable[str],
    *,
    weights: Mapping[str, float],
    count: int,
    start: Sequence[float] = (),
) -> dict[str, int]:
    """Each file's shard: the heaviest file first, each to the least loaded shard so far
    (ties: the lower shard index); equal weights go in name order."""
    if count < 1:
        raise ValueError(f"TG_SHARD: the shard count must be >= 1, got {count}")
    names = sorted(set(files))
    known = [weights[f] for f in names if f in weights]
    default = statistics.median(known) if known else 1.0
    # Every file costs at least 1 s (collection, imports): files measured at 0 still spread.
    cost = {f: max(1.0, weights.get(f, default)) for f in names}
    load = [float(start[i]) if i < len(start) else 0.0 for i in range(count)]
    out: dict[str, int] = {}
    for name in sorted(names, key=lambda f: (-cost[f], f)):
        target = min(range(count), key=lambda i: (load[i], i))
        out[name] = target
        load[target] += cost[name]
    return out


def parse(
    value: str, start: str = "", phases: Mapping[str, float] | None = None
) -> tuple[int, int, list[float]]:
    """``"k/n"`` and ``"a,b"`` -> (k, n, start loads), with errors that name the variable."""
    try:
        k_text, n_text = value.split("/")
        k, n = int(k_text), int(n_text)
    except ValueError:
        raise ValueError(f"TG_SHARD={value!r}: expected k/n, e.g. 0/2") from None
    if not 0 <= k < n:
        raise ValueError(f"TG_SHARD={value!r}: k must be in 0..n-1")
    loads: list[float] = []
    for part in (x.strip() for x in start.split(",") if x.strip()):
        try:
            loads.append(sum(_seconds(p, phases or {}) for p in part.split("+")))
        except ValueError:
            raise ValueError(
                f"TG_SHARD_START={start!r}: expected seconds or phase names joined by +, "
                f"e.g. 120,types+ray (phases known: {sorted(phases or {})})"
            ) from None
    return k, n, loads


def _seconds(part: str, phases: Mapping[str, float]) -> float:
    return phases[part] if part in phases else float(part)


def load_weights(
    path: Path = WEIGHTS,
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(seconds by test file, by phase, by test) of the measured run; empty if none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, {}, {}

    def floats(key: str) -> dict[str, float]:
        return {str(k): float(v) for k, v in data.get(key, {}).items()}

    # a --quick run's phases as quick.<phase> (TG_SHARD_START=quick.types+quick.ray,quick.unit)
    phases = {**floats("phase_s"), **{f"quick.{k}": v for k, v in floats("quick_phase_s").items()}}
    return floats("wall_s"), phases, floats("test_s")


def file_weights(nodeids: Iterable[str], tests: Mapping[str, float]) -> dict[str, float]:
    """Each file's seconds: the sum of its given tests' (a test not in ``tests``: their
    median)."""
    default = statistics.median(tests.values()) if tests else 1.0
    out: dict[str, float] = {}
    for nodeid in nodeids:
        f = nodeid.split("::")[0]
        out[f] = out.get(f, 0.0) + tests.get(nodeid, default)
    return out


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    value = os.environ.get("TG_SHARD", "")
    if not value:
        return
    weights, phases, tests = load_weights()
    if tests:
        weights = file_weights((i.nodeid for i in items), tests)
    try:
        k, n, start = parse(value, os.environ.get("TG_SHARD_START", ""), phases)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    shard = assign(
        (i.nodeid.split("::")[0] for i in items), weights=weights, count=n, start=start
    )
    keep = [i for i in items if shard[i.nodeid.split("::")[0]] == k]
    dropped = [i for i in items if shard[i.nodeid.split("::")[0]] != k]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
