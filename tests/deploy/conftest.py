"""Fixtures of the deployment tests (chart, manifests, images)."""

from __future__ import annotations

import pytest

from tests.deploy.chart import find_helm


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary; the test is skipped, with where it was looked for, when there is none."""
    try:
        return find_helm()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
