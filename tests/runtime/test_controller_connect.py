"""Connecting drivers: explicit loopback addresses, RAY_ADDRESS, clear failures."""

from __future__ import annotations

import json
import os
import socket

import pytest

from tests.fixtures_ray import RayCluster
from tgruntime.controller import RayConnectError
from tgruntime.controller.connect import connect, is_reachable, parse_address
from tgruntime.local.head import start_local_head, stop_local_head

pytestmark = pytest.mark.ray


def test_explicit_loopback_address_and_ray_address_env(ray_cluster: RayCluster) -> None:
    port = parse_address(ray_cluster.gcs_address)[1]
    out = ray_cluster.run_python(f"""
        import json, os
        from tgruntime.controller.connect import connect
        explicit = connect("127.0.0.1:{port}", ray_namespace="c1")
        import ray
        ray.shutdown()
        from_env = connect(ray_namespace="c2")   # RAY_ADDRESS, set by the fixture
        print(json.dumps({{"explicit": explicit.node_id, "env": from_env.node_id,
                          "dashboard": from_env.dashboard_url,
                          "ns": ray.get_runtime_context().namespace}}))
    """)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["explicit"] == res["env"] and res["ns"] == "c2"
    assert res["dashboard"].startswith("http://")


def test_unreachable_address_fails_within_its_timeout_and_clearly(ray_cluster: RayCluster) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    out = ray_cluster.run_python(f"""
        import json
        from tgruntime.controller import RayConnectError
        from tgruntime.controller.connect import connect
        try:
            connect("127.0.0.1:{port}", ray_namespace="nowhere", timeout_s=5)
            print(json.dumps({{"error": None}}))
        except RayConnectError as exc:
            print(json.dumps({{"error": str(exc)}}))
    """)
    res = json.loads(out.strip().splitlines()[-1])
    assert res["error"] and "no Ray GCS answers" in res["error"] and str(port) in res["error"]
    assert not is_reachable(f"127.0.0.1:{port}")
    with pytest.raises(RayConnectError, match="invalid Ray address"):
        parse_address("no-port-here")
    # a pid that is not a head's `ray start` (this pytest process) is never signalled
    assert stop_local_head(pid=os.getpid(), temp_dir="/tmp/tgray-none") is False


def test_reconnecting_with_another_namespace_is_refused(ray_driver: RayCluster) -> None:
    assert (
        connect(ray_driver.gcs_address, ray_namespace="tgtests").ray_namespace == "tgtests"
    )  # same: fine
    with pytest.raises(RayConnectError, match="already connected"):
        connect(ray_driver.gcs_address, ray_namespace="other")


def test_token_auth_cluster_with_explicit_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """The field note of docs/design.md, reproduced: a token-auth head (what ``ray start``
    makes whenever ~/.ray/auth_token exists), a driver given an explicit loopback address. Plain
    ``ray.init(address=...)`` fails with "Failed to connect to Ray cluster at <node ip>:<port>";
    ``connect`` uses the token and works."""
    import subprocess
    import sys
    import uuid

    token = uuid.uuid4().hex
    monkeypatch.setenv("TG_RAY_INCLUDE_DASHBOARD", "0")  # drivers only: ~6 CPU-s less to start
    head = start_local_head(
        num_cpus=1, env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}, timeout_s=180
    )
    try:
        env = {**os.environ, "RAY_AUTH_TOKEN": token}
        env.pop("RAY_AUTH_MODE", None)  # as on a machine where nobody set it
        env.pop("RAY_ADDRESS", None)
        plain = (
            f"import ray; ray.init(address={head.gcs_address!r}, namespace='p'); print('connected')"
        )
        ours = (
            "from tgruntime.controller.connect import connect; "
            f"connect({head.gcs_address!r}, ray_namespace='p'); print('connected')"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for code in (plain, ours)
        ]
        (plain_out, plain_err), (ours_out, ours_err) = (p.communicate(timeout=180) for p in procs)
        assert "connected" in ours_out, ours_err[-3000:]
        assert "connected" not in plain_out and "Failed to connect to Ray cluster" in plain_err
    finally:
        stop_local_head(head)
