"""Fixtures of the deployment tests (chart, manifests, images)."""

from __future__ import annotations

import pytest

from tests.deploy.chart import find_helm


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes ``helm`` runs in the plane phase of tools/test.sh (marker ``k8s``):
    helm comes from the control plane's tool set (hack/build-tools.sh), which on a cold
    machine is still building while the unit phase runs, so there it would only be skipped.
    ``tryfirst``: before ``-m`` deselects."""
    for item in items:
        if "helm" in getattr(item, "fixturenames", ()) and item.get_closest_marker("k8s") is None:
            item.add_marker(pytest.mark.k8s)


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary; the test is skipped, with where it was looked for, when there is none."""
    try:
        return find_helm()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
