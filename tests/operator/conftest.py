"""Fixtures for the operator's tests: where the local Ray is."""

from __future__ import annotations

import dataclasses
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

# The operator's tests run groups of hack.noop_worker:NoopWorker: the Ray job
# drivers and worker processes import it, and they inherit their environment from the
# process that started the Ray head. Put the repository on PYTHONPATH before the session's
# Ray head (tests/fixtures_ray.py) starts.
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if str(REPO) not in _paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *_paths])


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
    """The local Ray's dashboard URL and GCS address, from the shared ``ray_cluster``.

    ``TG_TEST_RAY_ADDRESS`` + ``TG_TEST_DASHBOARD_URL`` reuse a running head (see
    tests/fixtures_ray.py); start it with the repository root on PYTHONPATH.
    """
    try:
        cluster = request.getfixturevalue("ray_cluster")
    except pytest.FixtureLookupError:
        pytest.skip("no local Ray: the ray_cluster fixture (tests/fixtures_ray.py) is missing")
    url = _attr(cluster, "dashboard_url")
    gcs = _attr(cluster, "gcs_address")
    if not gcs:
        pytest.fail(f"ray_cluster has no gcs_address: {cluster!r}")
    if not url or os.environ.get("TG_RAY_INCLUDE_DASHBOARD", "1") == "0":
        why = (
            "the local Ray runs without its dashboard (TG_RAY_INCLUDE_DASHBOARD=0, or no "
            "TG_TEST_DASHBOARD_URL with TG_TEST_RAY_ADDRESS): EVERY operator-on-Kubernetes "
            "test is skipped, since the operator talks to Ray only through the dashboard's "
            "Jobs and State APIs. Unset TG_RAY_INCLUDE_DASHBOARD to run them."
        )
        # loud: a warning in the session summary as well as the skip reason
        warnings.warn(pytest.PytestWarning(why), stacklevel=1)
        pytest.skip(why)
    if not url.startswith("http"):
        url = f"http://{url}"
    return RayEndpoint(dashboard_url=url.rstrip("/"), gcs_address=gcs)


# -- the real-plane operator tests' namespace and operator (one per test module) ----------
# A module sets OPERATOR_ENV (extra operator environment) to tune its operator.


@pytest.fixture(scope="module")
def ns(k8s_plane: Any) -> Iterator[str]:
    """A fresh namespace for the module, with its default ServiceAccount ready."""
    from hack import operator_plane as ks

    name = f"tgop-{uuid.uuid4().hex[:8]}"
    k8s_plane.kubectl("create", "namespace", name)
    ks.wait_for(
        lambda: k8s_plane.kubectl("get", "sa", "default", "-n", name, check=False).returncode
        == 0,
        timeout=60,
        what="the namespace's default ServiceAccount",
    )
    yield name
    k8s_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    request: pytest.FixtureRequest,
    k8s_plane: Any,
    ns: str,
    ray_endpoint: RayEndpoint,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    """The operator (least-privilege account) watching ``ns``, for the whole module."""
    from hack import operator_plane as ks

    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with ks.running_operator(
        k8s_plane,
        namespace=ns,
        ray_dashboard=ray_endpoint.dashboard_url,
        ray_gcs=ray_endpoint.gcs_address,
        log_path=log,
        extra_env=dict(getattr(request.module, "OPERATOR_ENV", {})),
    ) as op:
        yield op
    print(f"operator log: {log}")
