"""Worker health from Ray's own records, without calling into (or killing) the caller.

The state comes from the GCS through Ray's State API (the dashboard): ALIVE, or DEAD with
Ray's death cause (process killed, constructor raised, node died...). Actors that are
being created or restarted are UNREACHABLE. If the State API cannot be reached, each
worker is pinged instead (``__ray_ready__``, bounded by the timeout): an answer is
ALIVE, an actor error DEAD, silence UNREACHABLE (a worker busy with a long call
answers only when the call ends: its calls run one at a time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from tgapi.workers import WorkerState, describe_worker
from tgruntime.controller.calls import actor_error_cause


@dataclass(frozen=True)
class WorkerHealth:
    """One worker's health: its rank and name, state, cause (when not ALIVE), node and pid."""

    rank: int
    name: str
    state: WorkerState  # tgapi.workers: the one vocabulary (tgctl, the operator, here)
    cause: str
    node_id: str
    pid: int


def dashboard_url() -> str:
    """The connected cluster's dashboard (State API) URL, read from its GCS.

    Always pass this to the State API: given no address, Ray's State API auto-detects
    "the" local cluster (wrong when several run on one machine) and re-points this
    process's internal KV client at whatever it found.
    """
    from ray._private import ray_constants
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(
        ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD
    )
    if not raw:
        raise RuntimeError(
            "this Ray cluster publishes no dashboard address (started without the dashboard?)"
        )
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text if "://" in text else f"http://{text}"


def list_namespace_actors(
    ray_namespace: str, *, timeout_s: float, detail: bool = True
) -> list[Any]:
    """Actors of a Ray namespace from the State API (raises if the API cannot be reached)."""
    from ray.util.state import list_actors

    return list(
        list_actors(
            address=dashboard_url(),
            filters=[("ray_namespace", "=", ray_namespace)],
            detail=detail,
            limit=10_000,
            timeout=max(1, int(timeout_s)),
            raise_on_missing_output=False,
        )
    )


def group_health(
    *,
    ray_namespace: str,
    worker_names: Sequence[str],
    actor_ids: Sequence[str | None],
    handles: Sequence[Any | None],
    timeout_s: float,
) -> list[WorkerHealth]:
    try:
        actors = list_namespace_actors(ray_namespace, timeout_s=timeout_s)
    except Exception:
        return _probe(worker_names=worker_names, handles=handles, timeout_s=timeout_s)
    by_id = {a.actor_id: a for a in actors}
    by_name: dict[str, Any] = {}
    for a in actors:
        if a.name and (a.name not in by_name or by_name[a.name].state == "DEAD"):
            by_name[a.name] = a
    out = []
    for rank, (name, actor_id) in enumerate(zip(worker_names, actor_ids, strict=True)):
        entry = by_id.get(actor_id) if actor_id else None
        if entry is None:
            entry = by_name.get(name)
        out.append(_from_state(rank, name, entry))
    return out


def _from_state(rank: int, name: str, entry: Any) -> WorkerHealth:
    if entry is None:
        state, cause = describe_worker(ray_state=None)
        return WorkerHealth(rank, name, state, cause, "", -1)
    state, cause = describe_worker(ray_state=entry.state, death_cause=entry.death_cause)
    return WorkerHealth(rank, name, state, cause, entry.node_id or "", int(entry.pid or -1))


def _probe(
    *, worker_names: Sequence[str], handles: Sequence[Any | None], timeout_s: float
) -> list[WorkerHealth]:
    refs: dict[int, Any] = {}
    for rank, handle in enumerate(handles):
        if handle is not None:
            refs[rank] = handle.__ray_ready__.remote()
    deadline = time.monotonic() + timeout_s
    pending = list(refs.values())
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(
            pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic())
        )
    pending_set = set(pending)
    out = []
    for rank, name in enumerate(worker_names):
        ref = refs.get(rank)
        if ref is None:
            # no handle: the name is free, so the actor died or never was (a probe cannot tell)
            cause = "no live actor of that name"
            out.append(WorkerHealth(rank, name, WorkerState.DEAD, cause, "", -1))
        elif ref in pending_set:
            cause = f"no answer within {timeout_s:g}s (busy or hung)"
            out.append(WorkerHealth(rank, name, WorkerState.UNREACHABLE, cause, "", -1))
        else:
            try:
                ray.get(ref, timeout=0)
                out.append(WorkerHealth(rank, name, WorkerState.ALIVE, "", "", -1))
            except RayActorError as exc:
                cause = actor_error_cause(exc)
                out.append(WorkerHealth(rank, name, WorkerState.DEAD, cause, "", -1))
            except RayError as exc:
                cause = str(exc).splitlines()[0]
                out.append(WorkerHealth(rank, name, WorkerState.UNREACHABLE, cause, "", -1))
    return out
