"""Read a group from Ray's GCS without being a Ray driver, and light actor handles.

``GcsView(address)``
    A GCS client only (no ``ray.init``, no worker process, no import of the worker
    class): the group record and members keys from Ray's internal KV, the actor table
    (name, state, pid, node, placement group, death cause) and the dashboard address.
    ``tgctl status`` and ``tgctl up``'s progress use it. Needs no dashboard.

``use_light_handles()``
    Make ``ray.get_actor`` in this driver build an actor handle without importing the
    actor's class. Ray's driver otherwise unpickles the worker class (for the
    built-in trainer: megatron-core and torch, 10 s and more) only to learn its method
    names. The class's export in the GCS already lists them; the handle gets a stand-in
    class with those names (every method: one return value, default options). Calls on
    it reach the real actor unchanged. Teardown, ``tgctl down`` and the client use it;
    a worker class whose methods use ``@ray.method(num_returns=...)`` or concurrency
    groups must be attached without it (``TG_LIGHT_HANDLES=0``).
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tgruntime.controller import naming
from tgruntime.controller.errors import RayConnectError

_ACTOR_STATES = {
    0: "DEPENDENCIES_UNREADY",
    1: "PENDING_CREATION",
    2: "ALIVE",
    3: "RESTARTING",
    4: "DEAD",
}


@dataclass(frozen=True)
class ActorInfo:
    """One row of the GCS actor table."""

    actor_id: str
    name: str
    ray_namespace: str
    state: str  # DEPENDENCIES_UNREADY, PENDING_CREATION, ALIVE, RESTARTING, DEAD
    pid: int
    node_id: str
    placement_group_id: str
    class_name: str
    death_cause: dict[str, Any] = field(default_factory=dict)


def actor_infos(gcs_client: Any, *, ray_namespace: str | None, timeout_s: float) -> list[ActorInfo]:
    """The actor table (optionally one Ray namespace) from a GCS client (a driver's or ours)."""
    from google.protobuf.json_format import MessageToDict

    async def fetch() -> Any:
        return await gcs_client.async_get_all_actor_info(timeout=timeout_s)

    table = asyncio.run(asyncio.wait_for(fetch(), timeout=timeout_s + 1))
    out = []
    for actor_id, row in table.items():
        if ray_namespace is not None and row.ray_namespace != ray_namespace:
            continue
        cause: dict[str, Any] = {}
        if row.HasField("death_cause"):
            cause = MessageToDict(row.death_cause, preserving_proto_field_name=True)
        out.append(
            ActorInfo(
                actor_id=actor_id.hex(),
                name=row.name,
                ray_namespace=row.ray_namespace,
                state=_ACTOR_STATES.get(int(row.state), str(row.state)),
                pid=int(row.pid),
                node_id=row.address.node_id.hex() if row.address.node_id else "",
                placement_group_id=row.placement_group_id.hex() if row.placement_group_id else "",
                class_name=row.class_name,
                death_cause=cause,
            )
        )
    return out


class GcsView:
    """A driver-less view of one Ray cluster's GCS (``host:port``)."""

    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        from tgruntime.controller import connect as ray_connect
        from tgruntime.controller import ray_workarounds

        host, port = ray_connect.parse_address(address)
        if not ray_connect.is_reachable(address, timeout_s=min(timeout_s, 5.0)):
            raise RayConnectError(
                f"no Ray GCS answers at {host}:{port} (is the head running? right port? "
                "`tgctl up` starts one; --address or RAY_ADDRESS names another)"
            )
        ray_workarounds.prepare_token_auth()
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        self.address = f"{host}:{port}"
        self.timeout_s = timeout_s
        self._client = GcsClient(address=self.address)

    def kv_get(self, key: str, *, kv_namespace: str = naming.KV_NAMESPACE) -> bytes | None:
        try:
            raw = self._client.internal_kv_get(
                key.encode(), kv_namespace.encode(), timeout=self.timeout_s
            )
        except Exception as exc:
            raise RayConnectError(
                f"the GCS at {self.address} did not answer a KV read within {self.timeout_s:g}s: "
                f"{exc}. "
                "If the cluster uses token authentication, provide its token (RAY_AUTH_TOKEN, "
                "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
            ) from exc
        return None if raw is None else bytes(raw)

    def record(self, *, group_name: str, ray_namespace: str) -> Any:
        """The published GroupRecord, or None."""
        from tgruntime.controller.registry import GroupRecord

        raw = self.kv_get(naming.record_key(ray_namespace=ray_namespace, group_name=group_name))
        return None if raw is None else GroupRecord.from_json(raw)

    def members(self, *, group_name: str, ray_namespace: str) -> Any:
        """The members key claimed before creation (a group being created), or None."""
        from tgruntime.controller.registry import Members

        raw = self.kv_get(naming.members_key(ray_namespace=ray_namespace, group_name=group_name))
        return None if raw is None else Members.from_json(raw)

    def actors(self, *, ray_namespace: str) -> list[ActorInfo]:
        try:
            return actor_infos(self._client, ray_namespace=ray_namespace, timeout_s=self.timeout_s)
        except Exception as exc:
            raise RayConnectError(
                f"the GCS at {self.address} did not list its actors within {self.timeout_s:g}s: "
                f"{exc}"
            ) from exc

    def dashboard_url(self) -> str:
        """The dashboard's URL when the cluster runs one, else "" (TG_RAY_INCLUDE_DASHBOARD=0)."""
        from tgruntime.controller.connect import http_up

        raw = self.kv_get("dashboard", kv_namespace="dashboard")
        if not raw:
            return ""
        text = raw.decode()
        url = text if "://" in text else f"http://{text}"
        # A head started without the dashboard still publishes the address it would have
        # had: only a dashboard that answers counts (refused at once when there is none).
        return url if http_up(f"{url}/api/version", timeout_s=1.0) else ""


def by_name(actors: list[ActorInfo]) -> dict[str, ActorInfo]:
    """Actors by name; a live incarnation wins over a dead one of the same name."""
    out: dict[str, ActorInfo] = {}
    for a in actors:
        if a.name and (a.name not in out or out[a.name].state == "DEAD"):
            out[a.name] = a
    return out


# ============================================================================ light handles
def light_handles_enabled() -> bool:
    return os.environ.get("TG_LIGHT_HANDLES", "1") != "0"


def use_light_handles() -> bool:
    """Install the stand-in class loader in this process's Ray worker (idempotent).

    Returns whether it is installed (False with TG_LIGHT_HANDLES=0).
    """
    if not light_handles_enabled():
        return False
    from ray._private import function_manager, ray_constants

    manager_cls = function_manager.FunctionActorManager
    if getattr(manager_cls, "_tg_light", False):
        return True
    original: Callable[..., Any] = manager_cls._load_actor_class_from_gcs

    def load_names_only(self: Any, job_id: Any, descriptor: Any) -> Any:
        try:
            key = function_manager.make_function_table_key(
                b"ActorClass", job_id, descriptor.function_id.binary()
            )
            raw = self._worker.gcs_client.internal_kv_get(
                key, ray_constants.KV_NAMESPACE_FUNCTION_TABLE
            )
            # The export is a pickled dict of plain fields; the class itself inside it is a
            # further pickle, left unread here.
            names = json.loads(pickle.loads(raw)["actor_method_names"]) if raw else None
        except Exception:
            names = None
        if not names:
            return original(self, job_id, descriptor)
        return _stand_in_class(descriptor.class_name, descriptor.module_name, names)

    manager_cls._load_actor_class_from_gcs = load_names_only  # type: ignore[method-assign]
    manager_cls._tg_light = True  # type: ignore[attr-defined]
    return True


def _stand_in_class(class_name: str, module_name: str, method_names: list[str]) -> type:
    def make(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{class_name}.{name}: this is tgruntime's stand-in for an attached actor's "
                "class; it runs only in the actor"
            )

        method.__name__ = name
        return method

    body = {name: make(name) for name in method_names}
    cls = type(class_name, (), body)
    cls.__module__ = module_name
    return cls

