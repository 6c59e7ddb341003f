"""Ray fixtures: one real local Ray head per test session, on free loopback ports.

- ``ray_cluster`` (session): a head started with ``tgruntime.local.head.start_local_head``
  (dashboard on, its own temp dir, small: 4 logical CPUs, 1 GiB object store), stopped at
  the end. Its value is a frozen ``RayCluster``: ``gcs_address``, ``dashboard_url``,
  ``temp_dir`` and ``run_python(code)`` to run a snippet in a separate OS process already
  pointed at the cluster (``RAY_ADDRESS``), returning its stdout. The Megatron modules' groups
  (two 1-CPU workers each; one module holds two groups at once) run on it too, through
  ``ray_driver``, instead of a private local Ray per module (12-15 CPU s each to start).
- ``ray_driver`` (module): connects this pytest process to that head as a driver
  (namespace ``tgtests``) and disconnects after the module, so other modules may call
  ``ray.init`` themselves; tests create groups in namespaces of their own.

Tests that use them are marked ``@pytest.mark.ray``. Environment knobs:
``TG_TEST_RAY_ADDRESS`` reuses an already running head instead of starting one.

Authentication: Ray 2.60 turns token auth on for ``ray start`` whenever a token file
exists (~/.ray/auth_token, written by any new local ``ray.init()`` on this machine), and
then plain HTTP to the dashboard and drivers without the token are refused. The test
head, this process and every snippet therefore run with ``RAY_AUTH_MODE=disabled``
unless RAY_AUTH_MODE is already set.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def tgctl_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for a tgctl subprocess with no remembered head (it starts its own).

    The repository on PYTHONPATH, a private cache dir, Ray's token auth off unless the caller's
    environment sets it, and no RAY_ADDRESS / TG_RAY_ADDRESS leaking in; ``extra`` on top.
    """
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        **extra,
    }
    for key in ("RAY_ADDRESS", "TG_RAY_ADDRESS"):
        env.pop(key, None)
    return env


@dataclass(frozen=True)
class RayCluster:
    """A running local Ray head."""

    gcs_address: str
    dashboard_url: str
    temp_dir: str
    num_cpus: int
    _owned: bool = field(default=True, repr=False)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process: RAY_ADDRESS set, the repository importable."""
        env = {
            **os.environ,
            "RAY_ADDRESS": self.gcs_address,
            "TG_DASHBOARD_URL": self.dashboard_url,
        }
        paths = [str(REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.pop("RAY_API_SERVER_ADDRESS", None)
        env.update(extra or {})
        return env

    def run_python(
        self,
        code: str,
        *,
        timeout_s: float = 240,
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> str:
        """Run ``code`` with this Python in a new OS process; return its stdout.

        ``check``: raise AssertionError (with stdout and stderr) on a non-zero exit.
        A snippet that runs past ``timeout_s`` is killed and reported.
        """
        try:
            proc = subprocess.run(
                [sys.executable, "-c", textwrap.dedent(code)],
                cwd=REPO_ROOT,
                env=self.env(env),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"snippet timed out after {timeout_s:g}s\n--- stdout ---\n{exc.stdout!s}\n"
                f"--- stderr ---\n{exc.stderr!s}"
            ) from None
        if check and proc.returncode != 0:
            raise AssertionError(
                f"snippet exited with {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr "
                f"---\n{proc.stderr[-6000:]}"
            )
        return proc.stdout


STARTUP_TRIES = 3
T = TypeVar("T")


def init_private_ray(*, namespace: str, num_cpus: int = 4) -> None:
    """``ray.init`` of a private local cluster for this process (no dashboard), tried up to
    STARTUP_TRIES times.

    Ray gives a new raylet a fixed 30 s to register with its GCS (``ray/_private/node.py``,
    not configurable); on a loaded 2-core machine (two test lanes, kind) it can miss that and
    ``ray.init`` raises "The current node timed out during startup". The processes of the
    failed try are this process's children: they are killed before the next try.
    """
    import ray

    def start() -> None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace=namespace)

    with_startup_tries(start, ray.shutdown, what="init_private_ray")


def with_startup_tries(start: Callable[[], T], undo: Callable[[], object], *, what: str) -> T:
    """``start()`` tried up to STARTUP_TRIES times while it fails on Ray's fixed raylet
    registration wait ("timed out during startup"); between tries ``undo()`` runs and the
    processes the failed try started (this process's new children) are killed."""
    import psutil

    me = psutil.Process()
    for attempt in range(1, STARTUP_TRIES + 1):
        before = {c.pid for c in me.children(recursive=True)}
        try:
            return start()
        except Exception as exc:
            # Ray's raylet registration wait, or a GCS port chosen free and taken before the
            # GCS bound it ("Failed to start GCS", quick run of 2026-12-06 12:47): a new try
            # picks a new port
            retry = any(m in str(exc) for m in ("timed out during startup", "Failed to start GCS"))
            if not retry or attempt == STARTUP_TRIES:
                raise
            undo()
            for child in me.children(recursive=True):
                if child.pid not in before:
                    child.kill()
            print(f"{what}: try {attempt} timed out during Ray's startup; again", file=sys.stderr)
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A local Ray head for the whole session (started on free ports, stopped at the end)."""
    from tgruntime.local import head as local_head

    auth_was = os.environ.get("RAY_AUTH_MODE")
    if auth_was is None:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        _refresh_ray_config()
    reuse = os.environ.get("TG_TEST_RAY_ADDRESS")
    if reuse:
        dashboard = os.environ.get("TG_TEST_DASHBOARD_URL", "")
        yield RayCluster(
            gcs_address=reuse, dashboard_url=dashboard, temp_dir="", num_cpus=0, _owned=False
        )
        return
    head = local_head.start_local_head(
        num_cpus=4, object_store_memory=1 << 30, timeout_s=300,
        env={"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]},
    )
    up_file = os.environ.get("TG_RAY_UP_FILE")
    if up_file:  # tools/test.sh: kind-prep's image loads wait for this head (docs/testing.md)
        Path(up_file).touch()
    try:
        yield RayCluster(
            gcs_address=head.gcs_address, dashboard_url=head.dashboard_url, temp_dir=head.temp_dir,
            num_cpus=head.num_cpus,
        )
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        local_head.stop_local_head(head)
        if auth_was is None:
            os.environ.pop("RAY_AUTH_MODE", None)
            _refresh_ray_config()


def _refresh_ray_config() -> None:
    """Make this process's cached Ray config see RAY_AUTH_MODE (as Ray's own switch does)."""
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]  # Cython, not in the stub

        Config.initialize("")
    except Exception:
        pass


@pytest.fixture(scope="module")
def ray_driver(ray_cluster: RayCluster) -> Iterator[RayCluster]:
    """This pytest process connected to ``ray_cluster`` as a driver."""
    import ray

    from tgruntime.controller.connect import connect

    connect(ray_cluster.gcs_address, ray_namespace="tgtests")
    try:
        yield ray_cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture
def unique_namespace() -> str:
    """A fresh Ray namespace, so tests never see each other's groups."""
    return f"t-{uuid.uuid4().hex[:10]}"
