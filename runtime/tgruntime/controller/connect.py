"""Reaching Ray: a robust ``connect`` for drivers, and the one Ray address variable.

``connect(address, ray_namespace=...)``
    ``ray.init`` with checks first, so failures say what is wrong instead of Ray's
    "Failed to connect to Ray cluster at <node ip>:<port>" after a long wait:

    1. the GCS port must answer a TCP connect (else: nothing listens there);
    2. the two workarounds of ``tgruntime.controller.ray_workarounds`` (token auth for an explicit
       address; the local node's registered IP for a loopback address), each with its
       upstream issue; when no node of that cluster runs on this machine, we say so (a
       driver must run on a cluster node: submit it as a Ray job instead);
    3. when the GCS answers TCP but refuses the driver, the likely cause is named.

``address_from_env()``
    The one environment variable for the Ray address, in every entrypoint (tgctl, server,
    client, teardown): ``RAY_ADDRESS`` (Ray's own). ``TG_RAY_ADDRESS`` is still read when
    RAY_ADDRESS is unset, with a deprecation note.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import ray

from tgruntime.controller import ray_workarounds
from tgruntime.controller.errors import RayConnectError
from tgruntime.controller.naming import validate_namespace


@dataclass(frozen=True)
class Connection:
    """The Ray cluster a driver is connected to."""

    gcs_address: str
    ray_namespace: str
    node_id: str
    node_ip: str
    dashboard_url: str


log = logging.getLogger("tgruntime.controller.connect")

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


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayConnectError(
            f"invalid Ray address {address!r}: expected host:port (or 'auto', or ray://host:port)"
        )
    return host.strip("[]"), int(port)


def is_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        host, port = parse_address(address)
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (OSError, RayConnectError):
        return False


def http_up(url: str, timeout_s: float = 2.0) -> bool:
    """The server answers HTTP (401/403 count: a token-protected dashboard is up)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return 200 <= int(resp.status) < 500
    except urllib.error.HTTPError as exc:
        return exc.code in (401, 403)
    except Exception:
        return False


def connect(
    address: str | None = None,
    *,
    ray_namespace: str,
    timeout_s: float = 30,
    log_to_driver: bool = False,
    runtime_env: dict[str, Any] | None = None,
    **init_kwargs: Any,
) -> Connection:
    """Connect this process to Ray as a driver in ``ray_namespace`` (explicit, never anonymous).

    ``init_kwargs`` go to ``ray.init``; its ``namespace`` is ``ray_namespace`` here (the old
    keyword ``namespace=`` was removed: passing it is a TypeError, never a silent override).

    ``address``: ``host:port`` of the GCS, ``auto`` (the cluster started on this machine),
    ``ray://host:port`` (Ray client; a last resort), or None (``address_from_env()``:
    RAY_ADDRESS, else the deprecated TG_RAY_ADDRESS; else ``auto``).
    """
    if "namespace" in init_kwargs:
        raise TypeError(
            "connect() got an unexpected keyword argument 'namespace': pass ray_namespace"
        )
    ns = validate_namespace(ray_namespace)
    if ray.is_initialized():
        current = ray.get_runtime_context().namespace
        if current != ns:
            raise RayConnectError(
                f"this process is already connected to Ray in Ray namespace {current!r}, not "
                f"{ns!r}; call ray.shutdown() first"
            )
        return _connection(ns)
    raw = (address or address_from_env() or "auto").strip()
    inline_small_arguments()
    kwargs: dict[str, Any] = {
        "namespace": ns, "log_to_driver": log_to_driver, **init_kwargs
    }
    if runtime_env is not None:
        kwargs["runtime_env"] = runtime_env
    if raw.startswith("ray://") or raw == "auto":
        try:
            ray.init(address=raw, **kwargs)
        except Exception as exc:
            raise RayConnectError(f"ray.init(address={raw!r}) failed: {exc}") from exc
        return _connection(ns)

    host, port = parse_address(raw)
    error = _tcp_error(host, port, timeout_s=min(timeout_s, 5.0))
    if error:
        raise RayConnectError(
            f"no Ray GCS answers at {host}:{port}: {error} (is the head running? right port?)"
        )
    auth = ray_workarounds.prepare_token_auth()
    nodes = ray_workarounds.cluster_nodes(f"{host}:{port}", timeout_s=timeout_s)
    local_ips = ray_workarounds.local_ips()
    local = sorted((n for n in nodes if n.ip in local_ips), key=lambda n: (not n.head, n.ip))
    if nodes and not local:
        raise RayConnectError(
            f"the Ray cluster at {host}:{port} has no node on this machine (its nodes: "
            f"{sorted(n.ip for n in nodes)}; this machine: {sorted(local_ips)}). A Ray driver "
            "must run on a cluster node: submit it as a Ray job (Jobs API), or use "
            "ray://<head>:10001 as a last resort"
        )
    if local:
        kwargs["_node_ip_address"] = local[0].ip
    try:
        ray.init(address=f"{host}:{port}", **kwargs)
    except Exception as exc:
        hint = ""
        if not nodes:
            hint = (
                " The GCS answered TCP but not this driver's requests: it probably requires "
                f"token authentication (this driver: {auth}). Provide the cluster's token "
                "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) or start the "
                "cluster with RAY_AUTH_MODE=disabled."
            )
        registered = [(n.ip, "head" if n.head else "worker") for n in nodes]
        raise RayConnectError(
            f"ray.init(address='{host}:{port}', _node_ip_address="
            f"{kwargs.get('_node_ip_address')!r}) failed: {exc}. Nodes registered in that "
            f"GCS: {registered}.{hint}"
        ) from exc
    return _connection(ns)


#: Ray passes a task argument by value in the call itself up to this size, and through the
#: shared-memory object store above it (Ray's default: 100 KiB). A training batch of 16 x 1024
#: int64 tokens is 128 KiB: through the store, each call took ~1.1 ms longer on an H200 host
#: (docs/gpu.md, "The group's own overhead").
INLINE_ARGUMENT_BYTES = 1 << 20
_INLINE_ENV = "RAY_max_direct_call_object_size"


def inline_small_arguments() -> None:
    """Before ``ray.init``: let this driver pass arguments up to 1 MiB inline (Ray's
    ``max_direct_call_object_size``), unless the environment already chose a size."""
    os.environ.setdefault(_INLINE_ENV, str(INLINE_ARGUMENT_BYTES))


def _connection(ray_namespace: str) -> Connection:
    ctx = ray.get_runtime_context()
    dash = ""
    with contextlib.suppress(Exception):
        dash = str(ray._private.worker.get_dashboard_url() or "")  # type: ignore[no-untyped-call]
    if dash and not dash.startswith("http"):
        dash = f"http://{dash}"
    return Connection(
        gcs_address=str(ctx.gcs_address),
        ray_namespace=ray_namespace,
        node_id=ctx.get_node_id(),
        node_ip=str(ray.util.get_node_ip_address()),  # type: ignore[no-untyped-call]
        dashboard_url=dash,
    )


def _tcp_error(host: str, port: int, *, timeout_s: float) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return ""
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
