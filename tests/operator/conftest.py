"""Fixtures for the operator's tests: where the local Ray is."""

from __future__ import annotations

import dataclasses
import os

import pytest


@dataclasses.dataclass(frozen=True)
class RayEndpoint:
    dashboard_url: str
    gcs_address: str


def _attr(obj: object, *names: str) -> str | None:
    for n in names:
        value = getattr(obj, n, None)
        if value:
            return str(value)
    return None


@pytest.fixture(scope="session")
def ray_endpoint(request: pytest.FixtureRequest) -> RayEndpoint:
    """The local Ray's dashboard URL and GCS address.

    From the shared ``ray_cluster`` fixture (tests/fixtures_ray.py), or from
    ``TG_TEST_RAY_DASHBOARD_URL`` + ``TG_TEST_RAY_GCS_ADDRESS`` (a Ray head you
    started with the repository root on its PYTHONPATH).
    """
    url = os.environ.get("TG_TEST_RAY_DASHBOARD_URL")
    gcs = os.environ.get("TG_TEST_RAY_GCS_ADDRESS")
    if url and gcs:
        return RayEndpoint(dashboard_url=url.rstrip("/"), gcs_address=gcs)
    try:
        cluster = request.getfixturevalue("ray_cluster")
    except pytest.FixtureLookupError:
        pytest.skip(
            "no local Ray: the ray_cluster fixture (tests/fixtures_ray.py) is not available "
            "and TG_TEST_RAY_DASHBOARD_URL/TG_TEST_RAY_GCS_ADDRESS are not set"
        )
    url = _attr(cluster, "dashboard_url", "dashboard")
    gcs = _attr(cluster, "gcs_address", "address", "gcs")
    if not url or not gcs:
        pytest.fail(f"ray_cluster fixture has no dashboard_url/gcs_address: {cluster!r}")
    if not url.startswith("http"):
        url = f"http://{url}"
    return RayEndpoint(dashboard_url=url.rstrip("/"), gcs_address=gcs)
