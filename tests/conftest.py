"""Shared pytest configuration: fixture plugins owned by each component's tests."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest

# Before any test module imports megatron-core: its import-time torch.compile decorations wait
# for a first call (tgruntime.trainer.deferred_compile), as in the runtime's own processes.
import tgruntime.trainer  # noqa: F401

# Each fixture module is owned by one part of the tree; a module that does not exist
# yet (or whose dependencies are missing) is simply not loaded.
_PLUGINS = ["tests.fixtures_ray", "tests.fixtures_k8s", "tests.shard"]
pytest_plugins = [p for p in _PLUGINS if importlib.util.find_spec(p) is not None]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write pytest's own exit status to ``$TG_PYTEST_STATUS_FILE`` once every result is
    reported, so that tools/test.sh can tell a test failure from a native crash of the
    interpreter's teardown that comes after (docs/testing.md, "A crash at exit")."""
    path = os.environ.get("TG_PYTEST_STATUS_FILE")
    if path:
        Path(path).write_text(f"{int(exitstatus)}\n")


_CPU_USAGE = os.environ.get("TG_CPU_USAGE_FILE", "")
_TEST_CPU = os.environ.get("TG_TEST_CPU_FILE", "")


def _cpu_ns() -> int | None:
    try:
        return int(Path(_CPU_USAGE).read_text())
    except (OSError, ValueError):
        return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Record each test's wall and CPU seconds (setup, call and teardown, every process it
    started: the phase's cgroup, tools/cpu_cgroup.sh) to ``$TG_TEST_CPU_FILE``; the phase
    table lists the costliest (docs/testing.md, "Where the time goes")."""
    if not (_CPU_USAGE and _TEST_CPU):
        yield
        return
    cpu0, t0 = _cpu_ns(), time.monotonic()
    yield
    cpu1, wall = _cpu_ns(), time.monotonic() - t0
    if cpu0 is None or cpu1 is None:
        return
    with open(_TEST_CPU, "a", encoding="utf-8") as f:
        f.write(f"{item.nodeid}\t{wall:.1f}\t{(cpu1 - cpu0) / 1e9:.1f}\n")


_SKIPS = os.environ.get("TG_SKIPS_FILE", "")


_FAILS = os.environ.get("TG_FAILS_FILE", "")


def _record_failure(report: pytest.TestReport) -> None:
    """Append a failed test's id, stage and first error line to ``$TG_FAILS_FILE``:
    tools/test.sh prints them as the run's last lines, which a truncated CI log still shows."""
    lines = [ln for ln in report.longreprtext.splitlines() if ln.strip()]
    errors = [ln.removeprefix("E").strip() for ln in lines if ln.startswith("E ")]
    first = " ".join((errors or lines[-1:] or ["(no message)"])[0].split())
    with open(_FAILS, "a", encoding="utf-8") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{first[:240]}\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append every skipped test's id and reason to ``$TG_SKIPS_FILE``: tools/skips.py counts
    them by reason and fails the run on a reason outside tests/skip-allow.txt (a broken
    install must not pass as skips). An expected failure (xfail) is not a skip. A failure
    goes to ``$TG_FAILS_FILE`` (:func:`_record_failure`)."""
    if _FAILS and report.failed:
        _record_failure(report)
    if not (_SKIPS and report.skipped) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ").replace("\t", " ").replace("\n", " ")
    with open(_SKIPS, "a", encoding="utf-8") as f:
        f.write(f"{report.nodeid}\t{reason}\n")
