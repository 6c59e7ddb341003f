"""Reaching Ray: a robust ``connect`` for drivers, and a local head for tests and tgctl.

``connect(address, namespace=...)``
    ``ray.init`` with checks first, so failures say what is wrong instead of Ray's
    "Failed to connect to Ray cluster at <node ip>:<port>" after a long wait:

    1. the GCS port must answer a TCP connect (else: nothing listens there);
    2. token authentication (the field note in docs/design.md): since Ray 2.5x, ``ray
       start`` turns token auth on whenever a token exists (~/.ray/auth_token is written
       by any new local ``ray.init()`` on the machine), and ``ray.init`` looks for the
       token only for ``address="auto"``/None. A driver given ``127.0.0.1:<port>`` then
       fails with "Failed to connect to Ray cluster at <node ip>:<port>" while "auto"
       works. ``connect`` enables token auth whenever a token is available (harmless
       against clusters without auth; RAY_AUTH_MODE, when set, wins) and names the
       likely cause when the GCS answers TCP but refuses the driver;
    3. Ray rewrites a loopback address (127.0.0.1, localhost) to this machine's node IP
       before connecting, and then looks for a local raylet by scanning processes. We ask
       the GCS for its nodes instead and pass the local node's registered IP explicitly
       (``_node_ip_address``), so an explicit ``127.0.0.1:<port>`` works whatever IP the
       head registered; when no node of that cluster runs on this machine, we say so (a
       driver must run on a cluster node: submit it as a Ray job instead).

``start_local_head(...)`` / ``stop_local_head(...)``
    ``ray start --head --block`` in its own session, with every port chosen free on this
    machine (several heads can coexist: other test sessions, other users), the dashboard
    on, and its own temp dir; ``env`` (e.g. ``{"RAY_AUTH_MODE": "disabled"}``) is passed to
    it. Stop ends exactly that head: its ``ray start`` process (by the pid kept when it was
    started; only by its GCS port for an old state file) and that process's descendants,
    found through psutil (portable: Linux and macOS, no /proc), SIGTERM then SIGKILL.

``address_from_env()``
    The one environment variable for the Ray address, in every entrypoint (tgctl, server,
    client, teardown): ``RAY_ADDRESS`` (Ray's own). ``TG_RAY_ADDRESS`` is still read when
    RAY_ADDRESS is unset, with a deprecation note.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from tgruntime.controller.errors import RayConnectError
from tgruntime.controller.naming import validate_namespace


@dataclass(frozen=True)
class Connection:
    """The Ray cluster a driver is connected to."""

    gcs_address: str
    namespace: str
    node_id: str
    node_ip: str
    dashboard_url: str


@dataclass(frozen=True)
class LocalHead:
    """A local Ray head started by ``start_local_head``."""

    gcs_address: str
    dashboard_url: str
    temp_dir: str
    pid: int  # the ``ray start --block`` process (its own session leader)
    num_cpus: int
    num_gpus: int
    log_path: str
    owns_temp_dir: bool = False  # created by start_local_head: removed by stop_local_head


log = logging.getLogger("tgruntime.ray_connect")

ADDRESS_ENV = "RAY_ADDRESS"
DEPRECATED_ADDRESS_ENV = "TG_RAY_ADDRESS"
_warned_deprecated = False


def address_from_env() -> str | None:
    """The Ray address from the environment: RAY_ADDRESS, else the deprecated TG_RAY_ADDRESS."""
    global _warned_deprecated
    value = os.environ.get(ADDRESS_ENV, "").strip()
    if value:
        return value
    old = os.environ.get(DEPRECATED_ADDRESS_ENV, "").strip()
    if old:
        if not _warned_deprecated:
            _warned_deprecated = True
            log.warning(
                "%s is deprecated and will be removed: set %s=%s instead (the variable every "
                "TrainerGroup entrypoint reads)", DEPRECATED_ADDRESS_ENV, ADDRESS_ENV, old,
            )
        return old
    return None


# ============================================================================ connect
def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayConnectError(f"invalid Ray address {address!r}: expected host:port (or 'auto', or ray://host:port)")
    return host.strip("[]"), int(port)


def is_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (OSError, RayConnectError):
        return False


def connect(
    address: str | None = None,
    *,
    namespace: str,
    timeout_s: float = 30,
    log_to_driver: bool = False,
    runtime_env: dict[str, Any] | None = None,
    **init_kwargs: Any,
) -> Connection:
    """Connect this process to Ray as a driver in ``namespace`` (explicit, never anonymous).

    ``address``: ``host:port`` of the GCS, ``auto`` (the cluster started on this machine),
    ``ray://host:port`` (Ray client; a last resort), or None (``address_from_env()``: RAY_ADDRESS,
    else the deprecated TG_RAY_ADDRESS; else ``auto``).
    """
    validate_namespace(namespace)
    if ray.is_initialized():
        current = ray.get_runtime_context().namespace
        if current != namespace:
            raise RayConnectError(
                f"this process is already connected to Ray in namespace {current!r}, not {namespace!r}; "
                "call ray.shutdown() first"
            )
        return _connection(namespace)
    raw = (address or address_from_env() or "auto").strip()
    kwargs: dict[str, Any] = {"namespace": namespace, "log_to_driver": log_to_driver, **init_kwargs}
    if runtime_env is not None:
        kwargs["runtime_env"] = runtime_env
    if raw.startswith("ray://") or raw == "auto":
        try:
            ray.init(address=raw, **kwargs)
        except Exception as exc:
            raise RayConnectError(f"ray.init(address={raw!r}) failed: {exc}") from exc
        return _connection(namespace)

    host, port = parse_address(raw)
    error = _tcp_error(host, port, timeout_s=min(timeout_s, 5.0))
    if error:
        raise RayConnectError(f"no Ray GCS answers at {host}:{port}: {error} (is the head running? right port?)")
    auth = prepare_token_auth()
    nodes = _cluster_nodes(f"{host}:{port}", timeout_s=timeout_s)
    local_ips = _local_ips()
    local = [n for n in nodes if n["ip"] in local_ips]
    if nodes and not local:
        raise RayConnectError(
            f"the Ray cluster at {host}:{port} has no node on this machine (its nodes: "
            f"{sorted(n['ip'] for n in nodes)}; this machine: {sorted(local_ips)}). A Ray driver must run "
            "on a cluster node: submit it as a Ray job (Jobs API), or use ray://<head>:10001 as a last resort"
        )
    if local:
        local.sort(key=lambda n: (not n["head"], n["ip"]))
        kwargs["_node_ip_address"] = local[0]["ip"]
    try:
        ray.init(address=f"{host}:{port}", **kwargs)
    except Exception as exc:
        hint = ""
        if not nodes:
            hint = (
                f" The GCS answered TCP but not this driver's requests: it probably requires token "
                f"authentication (this driver: {auth}). Provide the cluster's token (RAY_AUTH_TOKEN, "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) or start the cluster with RAY_AUTH_MODE=disabled."
            )
        raise RayConnectError(
            f"ray.init(address='{host}:{port}', _node_ip_address={kwargs.get('_node_ip_address')!r}) failed: "
            f"{exc}. Nodes registered in that GCS: {[(n['ip'], 'head' if n['head'] else 'worker') for n in nodes]}."
            + hint
        ) from exc
    return _connection(namespace)


def prepare_token_auth() -> str:
    """Use token authentication when a token is available, as Ray does for ``address="auto"``.

    Ray 2.60 enables token auth on ``ray start`` (and on a new local ``ray.init()``, which
    also writes ~/.ray/auth_token) whenever a token exists, but a driver given an explicit
    address does not look for one: it then fails with "Failed to connect to Ray cluster at
    <node ip>:<port>". A token-enabled driver also connects to clusters without auth, so
    enabling it whenever a token is available is safe. RAY_AUTH_MODE, when set, wins.
    Returns a description of the mode for error messages.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return f"RAY_AUTH_MODE={mode}"
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        enabled = maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception as exc:  # an older/newer Ray without this module
        return f"token auth not configurable here ({exc})"
    return "token auth (token found)" if enabled else "no token available"


def _connection(namespace: str) -> Connection:
    ctx = ray.get_runtime_context()
    node = ray._private.worker._global_node
    gcs = getattr(node, "gcs_address", "") if node is not None else ""
    ip = getattr(node, "node_ip_address", "") if node is not None else ""
    dash = ""
    with contextlib.suppress(Exception):
        dash = str(ray._private.worker.get_dashboard_url() or "")  # type: ignore[no-untyped-call]
    if dash and not dash.startswith("http"):
        dash = f"http://{dash}"
    return Connection(gcs_address=str(gcs), namespace=namespace, node_id=ctx.get_node_id(), node_ip=str(ip), dashboard_url=dash)


def _tcp_error(host: str, port: int, *, timeout_s: float) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _cluster_nodes(address: str, *, timeout_s: float) -> list[dict[str, Any]]:
    """Alive nodes registered in the GCS at ``address`` (empty if it cannot be asked)."""
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        client = GcsClient(address=address)
        infos = client.get_all_node_info(timeout=timeout_s)
    except Exception:
        return []
    out = []
    for info in infos.values():
        if int(getattr(info, "state", 0)) != 0:  # 0 = ALIVE
            continue
        out.append({"ip": info.node_manager_address, "head": bool(getattr(info, "is_head_node", False))})
    return out


def _local_ips() -> set[str]:
    ips = {"127.0.0.1", "::1", "localhost"}
    with contextlib.suppress(Exception):
        from ray._raylet import get_all_interfaces_ip  # type: ignore[attr-defined]

        ips.update(str(ip) for ip in get_all_interfaces_ip())
    with contextlib.suppress(Exception):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            ips.add(str(info[4][0]))
    with contextlib.suppress(Exception):
        ips.add(str(ray.util.get_node_ip_address()))  # type: ignore[no-untyped-call]
    return ips


# ============================================================================ local head
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
    """Start a Ray head on this machine on free ports, dashboard on; wait until it serves.

    ``num_cpus`` defaults to this machine's CPU count (rounded up to an integer, as ``ray
    start`` wants); ``num_gpus`` to 0 (logical GPUs for tests can be declared freely).
    """
    cpus = int(-(-float(num_cpus) // 1)) if num_cpus is not None else (os.cpu_count() or 1)
    gpus = int(num_gpus or 0)
    owns = temp_dir is None
    root = Path(temp_dir) if temp_dir else Path(tempfile.mkdtemp(prefix="tgray-", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    last_error = ""
    for _attempt in range(3):
        ports = {name: _free_port() for name in (
            "port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
            "node-manager-port", "object-manager-port",
        )}
        cmd = [
            _ray_executable(), "start", "--head", "--block", "--disable-usage-stats",
            f"--include-dashboard={'true' if _dashboard_wanted() else 'false'}", "--dashboard-host=127.0.0.1",
            f"--temp-dir={root}", f"--num-cpus={cpus}", f"--num-gpus={gpus}",
            *[f"--{name}={port}" for name, port in ports.items()],
        ]
        if object_store_memory:
            cmd.append(f"--object-store-memory={int(object_store_memory)}")
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        log_path = root / "ray-start.log"
        child_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **_SLOW_MACHINE_DEFAULTS, **(env or {})}
        child_env.pop(ADDRESS_ENV, None)
        child_env.pop(DEPRECATED_ADDRESS_ENV, None)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)
        gcs = f"127.0.0.1:{ports['port']}"
        # No dashboard (TG_RAY_INCLUDE_DASHBOARD=0): no URL, so nothing prints one.
        dashboard = f"http://127.0.0.1:{ports['dashboard-port']}" if _dashboard_wanted() else ""
        head = LocalHead(
            gcs_address=gcs, dashboard_url=dashboard, temp_dir=str(root), pid=proc.pid,
            num_cpus=cpus, num_gpus=gpus, log_path=str(log_path), owns_temp_dir=owns,
        )
        error = _wait_head(proc, head, timeout_s=timeout_s)
        if not error:
            return head
        last_error = error
        stop_local_head(head, keep_temp_dir=True)
    raise RayConnectError(f"local Ray head did not start: {last_error}")


# Ray's start-up deadlines assume an idle machine. On a loaded 2-core box the dashboard
# agent and workers importing torch/megatron can take minutes; raylet then aborts
# ("Timed out waiting for file .../dashboard_agent..."). Values already in the environment win.
_SLOW_MACHINE_DEFAULTS = {
    k: os.environ.get(k, v)
    for k, v in {
        "RAY_agent_register_timeout_ms": "300000",
        "RAY_worker_register_timeout_seconds": "600",
        "RAY_raylet_start_wait_time_s": "120",
    }.items()
}


def _dashboard_wanted() -> bool:
    """False when TG_RAY_INCLUDE_DASHBOARD=0 (machines without ray[default]'s extras, e.g. the GPU box)."""
    return os.environ.get("TG_RAY_INCLUDE_DASHBOARD", "1") != "0"


def _wait_head(proc: subprocess.Popen[bytes], head: LocalHead, *, timeout_s: float) -> str:
    """Wait for the GCS port, 'ray start' reporting the runtime started, and the dashboard.

    No GCS client is used here, so this works whatever the cluster's authentication mode.
    """
    deadline = time.monotonic() + timeout_s
    host, port = parse_address(head.gcs_address)
    gcs_up = started = dash_up = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"'ray start' exited with {proc.returncode}; log {head.log_path}:\n{_tail(head.log_path)}"
        if not gcs_up:
            gcs_up = not _tcp_error(host, port, timeout_s=1.0)
        if gcs_up and not started:
            started = "Ray runtime started" in _tail(head.log_path, lines=400)
        if started and not dash_up:
            # TG_RAY_INCLUDE_DASHBOARD=0: a head without the dashboard has nothing to wait for.
            dash_up = not _dashboard_wanted() or _http_up(f"{head.dashboard_url}/api/version")
        if gcs_up and started and dash_up:
            return ""
        time.sleep(0.25)
    return (
        f"not ready within {timeout_s:g}s (gcs port={gcs_up}, runtime started={started}, dashboard={dash_up}); "
        f"log {head.log_path}:\n{_tail(head.log_path)}"
    )


def _http_up(url: str, timeout_s: float = 2.0) -> bool:
    """The server answers HTTP (401/403 count: a token-protected dashboard is up)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 500
    except urllib.error.HTTPError as exc:
        return exc.code in (401, 403)
    except Exception:
        return False


def _tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def stop_local_head(
    head: LocalHead | None = None,
    *,
    gcs_address: str | None = None,
    pid: int | None = None,
    timeout_s: float = 15,
    keep_temp_dir: bool = False,
) -> bool:
    """Stop a head started by ``start_local_head`` (given the head, or its pid / GCS address).

    Ends that head's processes only: its ``ray start --block`` process (``head.pid`` or
    ``pid``, checked to be a ``ray start --head`` on that GCS port, so a reused pid is
    never hit; without a pid, the process whose command line has ``--head`` and
    ``--port=<gcs port>``) and all its descendants (GCS, raylet, dashboard, the workers,
    which make their own process groups), collected before anything is signalled. SIGTERM
    to the leader (it stops its children), then to the rest, SIGKILL after ``timeout_s``.
    Uses psutil (shipped with Ray), so it works on Linux and macOS alike. Returns False
    when nothing of that head was running. Given the LocalHead, the temp dir that
    ``start_local_head`` created is removed too (logs included) unless ``keep_temp_dir``.
    """
    import psutil

    if head is None and gcs_address is None and pid is None:
        raise ValueError("pass the LocalHead, its pid or its gcs_address")
    port = parse_address(head.gcs_address if head else str(gcs_address))[1] if (head or gcs_address) else None
    leader_pid = head.pid if head is not None else pid
    leaders: list[Any] = []
    if leader_pid is not None:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(leader_pid)
            if _is_head_process(proc, port):
                leaders.append(proc)
    if not leaders and port is not None:
        # An old state file without the pid: find the head by its command line.
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.uids().real == os.getuid() and _is_head_process(proc, port):
                    leaders.append(proc)
    victims: dict[int, Any] = {}
    for leader in leaders:
        victims[leader.pid] = leader
        with contextlib.suppress(psutil.Error):
            for child in leader.children(recursive=True):
                victims[child.pid] = child
    victims.pop(os.getpid(), None)
    if not victims:
        _remove_temp_dir(head, keep_temp_dir)
        return False
    # 'ray start --block' stops its own children promptly on SIGTERM (Ray's daemons
    # themselves may take their time over it): leader first, then the rest, then SIGKILL.
    deadline = time.monotonic() + timeout_s
    everyone = list(victims.values())
    for group in (leaders, everyone):
        for proc in group:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        phase_s = max(0.1, min(deadline, time.monotonic() + max(1.0, timeout_s / 2)) - time.monotonic())
        _, alive = psutil.wait_procs(everyone, timeout=phase_s)
        if not alive:
            break
    _, alive = psutil.wait_procs(everyone, timeout=0)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    _remove_temp_dir(head, keep_temp_dir)
    return True


def _is_head_process(proc: Any, port: int | None) -> bool:
    """Whether ``proc`` is a ``ray start --head`` (on GCS ``port`` when given)."""
    cmd = [str(c) for c in proc.cmdline()]
    if "start" not in cmd or "--head" not in cmd:
        return False
    return port is None or _has_flag(cmd, "--port", str(port))


def _remove_temp_dir(head: LocalHead | None, keep: bool) -> None:
    if head is not None and head.owns_temp_dir and not keep and head.temp_dir.startswith("/tmp/tgray-"):
        shutil.rmtree(head.temp_dir, ignore_errors=True)


def _has_flag(cmd: list[str], flag: str, value: str) -> bool:
    if f"{flag}={value}" in cmd:
        return True
    return any(arg == flag and i + 1 < len(cmd) and cmd[i + 1] == value for i, arg in enumerate(cmd))
