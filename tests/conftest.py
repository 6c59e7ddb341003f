"""Shared pytest configuration: fixture plugins owned by each component's tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# Each fixture module is owned by one part of the tree; a module that does not exist
# yet (or whose dependencies are missing) is simply not loaded.
_PLUGINS = ["tests.fixtures_ray", "tests.fixtures_k8s"]
pytest_plugins = [p for p in _PLUGINS if importlib.util.find_spec(p) is not None]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write pytest's own exit status to ``$TG_PYTEST_STATUS_FILE`` once every result is
    reported, so that tools/test.sh can tell a test failure from a native crash of the
    interpreter's teardown that comes after (docs/testing.md, "A crash at exit")."""
    path = os.environ.get("TG_PYTEST_STATUS_FILE")
    if path:
        Path(path).write_text(f"{int(exitstatus)}\n")
