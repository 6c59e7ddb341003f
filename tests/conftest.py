"""Shared pytest configuration: fixture plugins owned by each component's tests."""

from __future__ import annotations

import importlib.util

# Each fixture module is owned by one part of the tree; a module that does not exist
# yet (or whose dependencies are missing) is simply not loaded.
_PLUGINS = ["tests.fixtures_ray", "tests.fixtures_k8s"]
pytest_plugins = [p for p in _PLUGINS if importlib.util.find_spec(p) is not None]
