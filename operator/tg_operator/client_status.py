"""Read a TrainerGroup's status from Kubernetes and wait until it is Ready.

For the runtime's client (``tgruntime.client --trainergroup NAME``): it imports
this module, waits for Ready and attaches with ``workerNames``, ``rayNamespace``
and ``rayAddress``. Only the ``kubernetes`` client and tgapi are imported here
(no kopf, no Ray). Credentials: ``kubeconfig`` if given, else the pod's service
account, else ``$KUBECONFIG`` / ``~/.kube/config``. The client's service account
needs ``get`` on ``trainergroups`` in its namespace, nothing more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from tg_operator.kube import KubeApi, api_client, default_namespace
from tgapi import (
    SpecErrors,
    TimeoutsSpec,
    TrainerGroupSpec,
    TrainerGroupStatus,
    parse_resource,
    parse_status,
)


class ReadyGroup(NamedTuple):
    """A Ready TrainerGroup: its status (the client contract) and its parsed spec.

    A tuple, so ``status, spec = wait_for_ready_sync(...)`` works.
    """

    status: TrainerGroupStatus
    spec: TrainerGroupSpec


class TrainerGroupNotFound(LookupError):
    """No TrainerGroup with that name in that namespace."""


class TrainerGroupFailed(RuntimeError):
    """The TrainerGroup's phase is Failed."""

    def __init__(self, message: str, *, status: TrainerGroupStatus) -> None:
        super().__init__(message)
        self.status = status


class TrainerGroupNotReady(TimeoutError):
    """The TrainerGroup did not become Ready in time."""

    def __init__(self, message: str, *, status: TrainerGroupStatus | None) -> None:
        super().__init__(message)
        self.status = status


def is_ready(obj: dict[str, Any]) -> bool:
    """Ready for a client: phase Ready, for the current spec, with worker names."""
    st = parse_status(obj.get("status"))
    generation = int(obj.get("metadata", {}).get("generation") or 0)
    return st.phase == "Ready" and bool(st.worker_names) and st.observed_generation >= generation


def read_status(
    *, name: str, namespace: str | None = None, kubeconfig: str | None = None
) -> TrainerGroupStatus:
    """The current status (raises :class:`TrainerGroupNotFound`)."""
    ns = namespace or default_namespace(kubeconfig=kubeconfig)
    kube = KubeApi(api_client(kubeconfig=kubeconfig))
    try:
        obj = kube.get_trainergroup_sync(namespace=ns, name=name)
    finally:
        kube.close()
    if obj is None:
        raise TrainerGroupNotFound(f"TrainerGroup {ns}/{name} not found")
    return parse_status(obj.get("status"))


def wait_for_ready_sync(
    *,
    name: str,
    namespace: str | None = None,
    kubeconfig: str | None = None,
    timeout_s: float | None = None,
    poll_s: float = 2.0,
    on_progress: Callable[[TrainerGroupStatus], None] | None = None,
) -> ReadyGroup:
    """Poll until the TrainerGroup is Ready; its status and spec then.

    Raises :class:`TrainerGroupFailed` when the phase is Failed,
    :class:`TrainerGroupNotFound` when the object does not exist, and
    :class:`TrainerGroupNotReady` after ``timeout_s`` (default: the group's own Ready
    deadline, ``spec.timeouts`` clusterReadySeconds + workersReadySeconds, read from the
    object on the first poll). ``on_progress`` is called whenever the phase or message
    changes.
    """
    ns = namespace or default_namespace(kubeconfig=kubeconfig)
    kube = KubeApi(api_client(kubeconfig=kubeconfig))
    start = time.monotonic()
    last: TrainerGroupStatus | None = None
    try:
        while True:
            obj = kube.get_trainergroup_sync(namespace=ns, name=name)
            if obj is None:
                raise TrainerGroupNotFound(f"TrainerGroup {ns}/{name} not found")
            if timeout_s is None:
                timeout_s = float(ready_deadline(obj))
            deadline = start + timeout_s
            st = parse_status(obj.get("status"))
            if on_progress is not None and (
                last is None or (st.phase, st.message) != (last.phase, last.message)
            ):
                on_progress(st)
            last = st
            if is_ready(obj):
                return ReadyGroup(status=st, spec=parse_resource(obj).spec)
            generation = int(obj.get("metadata", {}).get("generation") or 0)
            if st.phase == "Failed" and st.observed_generation >= generation:
                raise TrainerGroupFailed(
                    f"TrainerGroup {ns}/{name} failed: {st.message}", status=st
                )
            if time.monotonic() >= deadline:
                raise TrainerGroupNotReady(
                    f"TrainerGroup {ns}/{name} not Ready after {timeout_s:g}s "
                    f"(phase {st.phase}: {st.message})",
                    status=st,
                )
            time.sleep(poll_s)
    finally:
        kube.close()


def ready_deadline(obj: Mapping[str, Any]) -> int:
    """A TrainerGroup object's Ready deadline in seconds (defaults when its spec is invalid)."""
    try:
        return parse_resource(obj).spec.timeouts.ready_seconds
    except SpecErrors:
        return TimeoutsSpec().ready_seconds


async def wait_for_ready(
    *,
    name: str,
    namespace: str | None = None,
    kubeconfig: str | None = None,
    timeout_s: float | None = None,
    poll_s: float = 2.0,
) -> ReadyGroup:
    """Async form of :func:`wait_for_ready_sync` (runs it in a worker thread)."""
    return await asyncio.to_thread(
        wait_for_ready_sync,
        name=name,
        namespace=namespace,
        kubeconfig=kubeconfig,
        timeout_s=timeout_s,
        poll_s=poll_s,
    )
