"""A local Ray head for tests, benchmarks and tgctl: ``ray start --head --block``, Ray's own.

Start: ``ray start --head --block`` in its own session with its own temp dir. Ray picks the
GCS port (``--port=0``) and the agents' ports; readiness is Ray's own address file
(``<temp dir>/ray_current_cluster``, which ``ray start`` writes once the node is up and
``ray.init(address="auto")`` reads), then the dashboard answering HTTP when there is one.

Two ports are still chosen here, because ``ray start`` has no automatic choice for them and
a second head on the same machine (another test session, another user) then dies at start:
the dashboard (8265, and no retry when the host is given) and the Ray client server
(10001). Measured on Ray 2.60: two heads with only ``--port=0`` → the second one's
ray_client_server exits with "address already in use" and ``--block`` stops that head.

Stop: SIGTERM to that ``ray start --block`` process, whose handler (Ray's) stops the node's
processes; what is left of its process tree after ``timeout_s`` gets SIGKILL. Not
``ray stop``: it stops every Ray process of the machine, other heads included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tgruntime.controller.connect import ADDRESS_ENV, DEPRECATED_ADDRESS_ENV, http_up, parse_address
from tgruntime.controller.errors import RayConnectError

ADDRESS_FILE = "ray_current_cluster"  # written by `ray start` into its temp dir


@dataclass(frozen=True)
class LocalHead:
    """A local Ray head started by ``start_local_head``."""

    gcs_address: str
    dashboard_url: str  # "" without the dashboard (TG_RAY_INCLUDE_DASHBOARD=0)
    temp_dir: str
    pid: int  # the ``ray start --block`` process (its own session leader)
    num_cpus: int
    num_gpus: int
    log_path: str
    owns_temp_dir: bool = False  # created by start_local_head: removed by stop_local_head


# Ray's start-up deadlines assume an idle machine. On a loaded 2-core box the dashboard
# agent and workers importing torch/megatron can take minutes; raylet then aborts
# ("Timed out waiting for file .../dashboard_agent..."). Values in the environment win.
_SLOW_MACHINE_DEFAULTS = {
    "RAY_agent_register_timeout_ms": "300000",
    "RAY_worker_register_timeout_seconds": "600",
    "RAY_raylet_start_wait_time_s": "120",
    # `ray start` waits this long for the dashboard (Ray: 60 s); at load 20 on 2 cores the
    # 2026-12-03 08:17 try took longer and the head was torn down
    "RAY_DASHBOARD_STARTUP_TIMEOUT_S": "300",
}


# No default workers prestarted when the first driver connects (Ray starts one per CPU then):
# the group's actors run in workers of their own runtime environment, so those sat idle after
# importing Ray (~2 CPU s each). Values in the environment win.
_HEAD_DEFAULTS = {"RAY_prestart_worker_first_driver": "0"}


START_ATTEMPTS = 5
"""Tries of ``ray start`` in ``start_local_head`` before it gives up."""


def dashboard_wanted() -> bool:
    """False when TG_RAY_INCLUDE_DASHBOARD=0 (machines without ray[default]'s extras)."""
    return os.environ.get("TG_RAY_INCLUDE_DASHBOARD", "1") != "0"


def start_local_head(
    *,
    num_cpus: float | None = None,
    num_gpus: int | None = None,
    object_store_memory: int | None = None,
    resources: dict[str, float] | None = None,
    temp_dir: str | None = None,
    timeout_s: float = 90,
    env: dict[str, str] | None = None,
) -> LocalHead:
    """Start a Ray head on this machine and wait until it serves (dashboard included).

    ``num_cpus`` defaults to this machine's CPU count (rounded up to an integer, as ``ray
    start`` wants); ``num_gpus`` to 0 (logical GPUs for tests can be declared freely).
    ``env`` (e.g. ``{"RAY_AUTH_MODE": "disabled"}``) is passed to the head's processes.
    """
    cpus = int(-(-float(num_cpus) // 1)) if num_cpus is not None else (os.cpu_count() or 1)
    gpus = int(num_gpus or 0)
    owns = temp_dir is None
    root = Path(temp_dir) if temp_dir else Path(tempfile.mkdtemp(prefix="tgray-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    child_env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        **{k: os.environ.get(k, v) for k, v in (_SLOW_MACHINE_DEFAULTS | _HEAD_DEFAULTS).items()},
        **(env or {}),
    }
    child_env.pop(ADDRESS_ENV, None)
    child_env.pop(DEPRECATED_ADDRESS_ENV, None)
    last_error = ""
    # A chosen port can be taken before Ray binds it, and under heavy load a raylet can miss
    # Ray's fixed 30 s registration wait ("The current node timed out during startup"): try
    # again. Nothing is retried once a head is up.
    for _attempt in range(START_ATTEMPTS):
        dashboard_port, client_port = _free_port(), _free_port()
        cmd = [
            _ray_executable(), "start", "--head", "--block", "--disable-usage-stats",
            "--port=0", "--dashboard-agent-listen-port=0", f"--temp-dir={root}",
            f"--include-dashboard={'true' if dashboard_wanted() else 'false'}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={client_port}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
        ]
        if object_store_memory:
            cmd.append(f"--object-store-memory={int(object_store_memory)}")
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        (root / ADDRESS_FILE).unlink(missing_ok=True)
        log_path = root / "ray-start.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
            )
        dashboard = f"http://127.0.0.1:{dashboard_port}" if dashboard_wanted() else ""
        gcs, error = _wait_head(proc, root, dashboard, timeout_s=timeout_s)
        head = LocalHead(
            gcs_address=gcs, dashboard_url=dashboard, temp_dir=str(root), pid=proc.pid,
            num_cpus=cpus, num_gpus=gpus, log_path=str(log_path), owns_temp_dir=owns,
        )
        if not error:
            return head
        last_error = error
        stop_local_head(head, keep_temp_dir=True)
    raise RayConnectError(f"local Ray head did not start: {last_error}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_executable() -> str:
    candidate = Path(sys.executable).with_name("ray")
    if candidate.exists():
        return str(candidate)
    found = shutil.which("ray")
    if not found:
        raise RayConnectError("the 'ray' command is not installed next to this Python nor on PATH")
    return found


def _wait_head(
    proc: subprocess.Popen[bytes], root: Path, dashboard: str, *, timeout_s: float
) -> tuple[str, str]:
    """(GCS address on loopback, "") once Ray's address file names it and the dashboard
    answers; ("", why) when ``ray start`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    log_path = root / "ray-start.log"
    gcs = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "", f"'ray start' exited with {proc.returncode}; {log_path}:\n{_tail(log_path)}"
        if not gcs:
            with contextlib.suppress(OSError):
                written = (root / ADDRESS_FILE).read_text().strip()
                if written:
                    gcs = f"127.0.0.1:{parse_address(written)[1]}"
        if gcs and (not dashboard or http_up(f"{dashboard}/api/version")):
            return gcs, ""
        time.sleep(0.25)
    return "", (
        f"not ready within {timeout_s:g}s (address file={bool(gcs)}, dashboard wanted="
        f"{bool(dashboard)}); {log_path}:\n{_tail(log_path)}"
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_local_head(
    head: LocalHead | None = None,
    *,
    pid: int | None = None,
    temp_dir: str | None = None,
    timeout_s: float = 30,
    keep_temp_dir: bool = False,
) -> bool:
    """Stop a head started by ``start_local_head``: the LocalHead, or its pid and temp dir.

    The pid is used only when that process is still a ``ray start --head`` with that temp
    dir (so a reused pid is never signalled). Returns False when that head was not running.
    Given the LocalHead, the temp dir ``start_local_head`` created is removed too (logs
    included) unless ``keep_temp_dir``.
    """
    import psutil

    leader_pid = head.pid if head is not None else pid
    root = head.temp_dir if head is not None else temp_dir
    if leader_pid is None or not root:
        raise ValueError("pass the LocalHead, or its pid and temp_dir")
    try:
        leader = psutil.Process(leader_pid)
        cmd = leader.cmdline()
        if "--head" not in cmd or f"--temp-dir={root}" not in cmd:
            leader = None
    except psutil.Error:
        leader = None
    if leader is None:
        _remove_temp_dir(head, keep_temp_dir)
        return False
    tree: list[Any] = [leader]
    with contextlib.suppress(psutil.Error):
        tree += leader.children(recursive=True)
    with contextlib.suppress(psutil.Error):
        leader.send_signal(signal.SIGTERM)  # Ray's handler stops the node's processes
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    _remove_temp_dir(head, keep_temp_dir)
    return True


def _remove_temp_dir(head: LocalHead | None, keep: bool) -> None:
    owned = head is not None and head.owns_temp_dir and head.temp_dir.startswith("/tmp/tgray-")
    if owned and head is not None and not keep:
        shutil.rmtree(head.temp_dir, ignore_errors=True)
