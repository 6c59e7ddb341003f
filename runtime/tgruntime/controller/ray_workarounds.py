"""Two workarounds that make an explicit loopback address (``127.0.0.1:<port>``) work.

Both reach into Ray's private modules, so both are guarded: by the installed Ray version
(the token workaround only from the release that brought the behaviour; both checked on
``CHECKED_RAY``), and by the import itself (a Ray without the private function gets no
workaround, and the error message says so).

1. Token authentication. Since Ray 2.59 (ray-project/ray#64755, cherry-picked into 2.59.0
   as ray-project/ray#66248), ``ray start`` turns token auth on whenever a token exists
   (``~/.ray/auth_token`` is written by any new local ``ray.init()`` on the machine), but
   ``ray.init(address=...)`` only looks for the token for ``address="auto"``/None; a driver
   given ``127.0.0.1:<port>`` fails with "Failed to connect to Ray cluster at <node
   ip>:<port>". The review of #64755 names this gap. ``prepare_token_auth`` turns token
   auth on whenever a token is available (harmless against clusters without auth;
   ``RAY_AUTH_MODE``, when set, wins).
2. Loopback rewriting. Ray rewrites a loopback address to this machine's node IP before
   connecting and then looks for a local raylet by that IP (ray-project/ray#59110, open,
   shows the same rewrite for ``ray start --address``). ``cluster_nodes`` asks the GCS
   for its nodes so that the driver can pass the local node's registered IP explicitly
   (``ray.init(_node_ip_address=...)``).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass

import ray

# The token-auth default arrived in 2.59.0 (ray-project/ray#66248); checked on 2.60.
TOKEN_AUTH_DEFAULT_SINCE = (2, 59)
CHECKED_RAY = (2, 60)


def ray_version() -> tuple[int, int]:
    """The installed Ray's (major, minor); (0, 0) for a version string we cannot read."""
    parts = ray.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def prepare_token_auth() -> str:
    """Use token authentication when a token is available, as Ray does for ``address="auto"``.

    Returns a description of the mode, for error messages.
    """
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return f"RAY_AUTH_MODE={mode}"
    version = ray_version()
    if version < TOKEN_AUTH_DEFAULT_SINCE:
        return f"no token auth default in Ray {ray.__version__}"
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        enabled = maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception as exc:  # a Ray newer than CHECKED_RAY that moved or dropped it
        return f"token auth not configurable in Ray {ray.__version__} ({exc})"
    return "token auth (token found)" if enabled else "no token available"


@dataclass(frozen=True)
class ClusterNode:
    """An alive node registered in a GCS."""

    ip: str
    head: bool


def cluster_nodes(address: str, *, timeout_s: float) -> list[ClusterNode]:
    """Alive nodes registered in the GCS at ``address`` (empty if it cannot be asked)."""
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        infos = GcsClient(address=address).get_all_node_info(timeout=timeout_s)
    except Exception:
        return []
    return [
        ClusterNode(ip=str(info.node_manager_address), head=bool(info.is_head_node))
        for info in infos.values()
        if int(info.state) == 0  # ALIVE
    ]


def local_ips() -> set[str]:
    """This machine's addresses, as Ray and the resolver see them."""
    ips = {"127.0.0.1", "::1", "localhost"}
    with contextlib.suppress(Exception):
        from ray._raylet import get_all_interfaces_ip  # type: ignore[attr-defined]

        ips.update(str(ip) for ip in get_all_interfaces_ip())
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            ips.add(str(info[4][0]))
    with contextlib.suppress(Exception):
        ips.add(str(ray.util.get_node_ip_address()))  # type: ignore[no-untyped-call]
    return ips
