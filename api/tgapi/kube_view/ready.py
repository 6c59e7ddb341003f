"""When a TrainerGroup object is Ready, Failed or past its deadline (pure; no Kubernetes client).

The decisions the waiter (:mod:`tgapi.kube_view.kube`) makes on each version of the object
it reads, kept apart so they are testable on plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from tgapi.errors import PicklableError, SpecErrors
from tgapi.model import TimeoutsSpec, TrainerGroupSpec
from tgapi.parse import parse_resource
from tgapi.status import TrainerGroupStatus, parse_status


class ReadyGroup(NamedTuple):
    """A Ready TrainerGroup: its status (the client contract) and its parsed spec.

    A tuple, so ``status, spec = wait_for_ready(...)`` works.
    """

    status: TrainerGroupStatus
    spec: TrainerGroupSpec


@dataclass(frozen=True, kw_only=True)
class AttachTarget:
    """Where a client attaches to a Ready TrainerGroup's group of workers."""

    ray_address: str | None  # the GCS (host:port); None: neither given nor in the status
    ray_namespace: str
    group_name: str
    worker_names: tuple[str, ...] = ()  # rank order


def attach_target(
    status: TrainerGroupStatus, *, name: str, address: str | None = None
) -> AttachTarget:
    """Where a client of the Ready TrainerGroup ``name`` attaches, from its status.

    The Ray address is ``address`` (a caller's override, e.g. ``--address``) else
    ``status.rayAddress``; the Ray namespace is ``status.rayNamespace``; the group is
    ``status.groupName``, else the TrainerGroup's own name. The one rule every client uses
    (``tg-client``, ``TrainerClient.connect`` and the Tinker server).
    """
    return AttachTarget(
        ray_address=address or status.ray_address or None,
        ray_namespace=status.ray_namespace,
        group_name=status.group_name or name,
        worker_names=tuple(status.worker_names),
    )


class TrainerGroupNotFound(PicklableError, LookupError):
    """No TrainerGroup with that name in that Kubernetes namespace (or it was deleted)."""


class TrainerGroupForbidden(PicklableError, PermissionError):
    """The API server refused the request (403): the credentials lack ``get``/``watch`` on it."""


class TrainerGroupFailed(PicklableError, RuntimeError):
    """The TrainerGroup's phase is Failed for its current spec."""

    def __init__(self, message: str, *, status: TrainerGroupStatus) -> None:
        super().__init__(message)
        self.status = status


class TrainerGroupNotReady(PicklableError, TimeoutError):
    """The TrainerGroup did not become Ready in time."""

    def __init__(self, message: str, *, status: TrainerGroupStatus | None) -> None:
        super().__init__(message)
        self.status = status


def _generation(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation") or 0)


def is_ready(obj: Mapping[str, Any]) -> bool:
    """Ready for a client: phase Ready, for the current spec, with worker names."""
    st = parse_status(obj.get("status"))
    return (
        st.phase == "Ready" and bool(st.worker_names) and st.observed_generation >= _generation(obj)
    )


def is_failed(obj: Mapping[str, Any]) -> bool:
    """Failed for the current spec (a Failed status of an older generation may still change)."""
    st = parse_status(obj.get("status"))
    return st.phase == "Failed" and st.observed_generation >= _generation(obj)


def ready_deadline(obj: Mapping[str, Any]) -> int:
    """A TrainerGroup object's Ready deadline in seconds (defaults when its spec is invalid).

    ``spec.timeouts`` clusterReadySeconds + workersReadySeconds.
    """
    try:
        return parse_resource(obj).spec.timeouts.ready_seconds
    except SpecErrors:
        return TimeoutsSpec().ready_seconds
