"""The teardown entrypoint never claims success it doesn't have: ``complete: false`` exits 3
(the operator then retries instead of re-creating the group), ``complete: true`` exits 0.

Real parts: the session's local Ray, a real detached group, the entrypoint in its own OS
process. The incomplete teardown is real too: ``--timeout 0`` checks once, right after the
kills, while the killed actors are still registered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.fixtures_ray import REPO_ROOT, RayCluster
from tests.runtime.light_workers import Counter
from tgruntime.controller import ResourcePool, WorkerGroup
from tgruntime.teardown import EXIT_INCOMPLETE

pytestmark = pytest.mark.ray


def _teardown(
    cluster: RayCluster, namespace: str, *extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "tgruntime.teardown", "--group", "td", "--ray-namespace", namespace,
         *extra],
        cwd=REPO_ROOT, env=cluster.env(), capture_output=True, text=True, timeout=180, check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TG_TEARDOWN ")]
    assert lines, proc.stdout + proc.stderr[-3000:]
    return proc, json.loads(lines[-1][len("TG_TEARDOWN "):])


def test_incomplete_teardown_exits_non_zero_and_a_retry_completes(
    ray_driver: RayCluster, unique_namespace: str
) -> None:
    pool = ResourcePool(process_on_nodes=[2], cpus_per_process=0.1)
    report: dict[str, Any] = {}
    for _attempt in range(3):  # the race is the point: the kill is asynchronous
        WorkerGroup.create(group_name="td", namespace=unique_namespace, resource_pool=pool, cls=Counter,
                           actor_timeout_s=180)
        proc, report = _teardown(ray_driver, unique_namespace, "--timeout", "0")
        if not report["complete"]:
            break
        assert proc.returncode == 0  # complete: true is success
    assert report["complete"] is False, report
    assert proc.returncode == EXIT_INCOMPLETE == 3
    assert "not fully removed" in proc.stderr and "do not re-create" in proc.stderr
    assert any("not everything was gone" in e for e in report["errors"])
    # Retried with time to finish: complete, exit 0, and idempotent.
    again, done = _teardown(ray_driver, unique_namespace, "--timeout", "60")
    assert (again.returncode, done["complete"]) == (0, True), again.stderr[-2000:]
    third, _ = _teardown(ray_driver, unique_namespace)
    assert third.returncode == 0
