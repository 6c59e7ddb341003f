"""Read a TrainerGroup from Kubernetes and wait for it with a watch (the ``kubernetes`` client).

Credentials: ``kubeconfig`` if given, else the pod's service account, else ``$KUBECONFIG`` /
``~/.kube/config``. Permissions: ``get`` and ``watch`` on the one TrainerGroup (no ``list``:
the watch is on the object by name, ``fieldSelector=metadata.name=NAME``, which a Role with
``resourceNames`` allows). ``tg_operator.rbac.CLIENT_RULES`` is that rule.

The wait reads the object once (``get``), then watches it from that ``resourceVersion`` until
a condition holds, the object is deleted or the deadline passes. A watch that the server ends
early is resumed from the last version seen; one whose version is too old (410 Gone) starts
again with a fresh ``get``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from tgapi.kube_view.ready import (
    ReadyGroup,
    TrainerGroupFailed,
    TrainerGroupForbidden,
    TrainerGroupNotFound,
    TrainerGroupNotReady,
    is_failed,
    is_ready,
    ready_deadline,
)
from tgapi.model import API_GROUP, API_VERSION, PLURAL
from tgapi.parse import parse_resource
from tgapi.status import TrainerGroupStatus, parse_status

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
HTTP_GONE = 410
# The longest one watch request stays open; the server may end it sooner (then it is resumed).
WATCH_CHUNK_S = 60.0
REQUEST_TIMEOUT_S = 30.0

TrainerGroupObject = dict[str, Any]


def api_client(*, kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """An API client from ``kubeconfig``, else in-cluster credentials, else ``$KUBECONFIG``."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return k8s.ApiClient(configuration)
    made = k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=kubeconfig, context=context
    )
    return cast(k8s.ApiClient, made)


def default_k8s_namespace(
    *, kubeconfig: str | None = None, service_account_file: str = SERVICE_ACCOUNT_NAMESPACE
) -> str:
    """The pod's Kubernetes namespace (its service account's), else the kubeconfig context's,
    else ``default``."""
    if kubeconfig is None and os.path.exists(service_account_file):
        with open(service_account_file) as f:
            return f.read().strip() or "default"
    try:
        _, active = k8s_config.list_kube_config_contexts(  # type: ignore[no-untyped-call]
            config_file=kubeconfig
        )
    except Exception:
        return "default"
    ns = (active or {}).get("context", {}).get("namespace")
    return str(ns) if ns else "default"


def _forbidden(exc: ApiException, *, k8s_namespace: str, name: str) -> Exception:
    """A 403 as TrainerGroupForbidden naming the fix; any other error as it is."""
    if exc.status != 403:
        return exc
    return TrainerGroupForbidden(
        f"TrainerGroup {k8s_namespace}/{name}: Forbidden ({exc.reason}); the credentials need "
        "get and watch on it (tg_operator.rbac.CLIENT_RULES, the chart's `clients` value)"
    )


def _get(custom: k8s.CustomObjectsApi, *, k8s_namespace: str, name: str) -> TrainerGroupObject:
    try:
        obj = custom.get_namespaced_custom_object(
            API_GROUP,
            API_VERSION,
            k8s_namespace,
            PLURAL,
            name,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    except ApiException as exc:
        if exc.status == 404:
            raise TrainerGroupNotFound(f"TrainerGroup {k8s_namespace}/{name} not found") from None
        raise _forbidden(exc, k8s_namespace=k8s_namespace, name=name) from exc
    return cast(TrainerGroupObject, obj)


def get_trainergroup(
    *, name: str, k8s_namespace: str | None = None, kubeconfig: str | None = None
) -> TrainerGroupObject:
    """The TrainerGroup object as the API server returns it (raises TrainerGroupNotFound)."""
    ns = k8s_namespace or default_k8s_namespace(kubeconfig=kubeconfig)
    api = api_client(kubeconfig=kubeconfig)
    try:
        return _get(k8s.CustomObjectsApi(api), k8s_namespace=ns, name=name)
    finally:
        api.close()  # type: ignore[no-untyped-call]


def read_status(
    *, name: str, k8s_namespace: str | None = None, kubeconfig: str | None = None
) -> TrainerGroupStatus:
    """The current status (raises :class:`TrainerGroupNotFound`)."""
    obj = get_trainergroup(name=name, k8s_namespace=k8s_namespace, kubeconfig=kubeconfig)
    return parse_status(obj.get("status"))


def _watch_once(
    custom: k8s.CustomObjectsApi,
    *,
    k8s_namespace: str,
    name: str,
    resource_version: str,
    seconds: float,
    seen: Callable[[TrainerGroupObject], bool],
) -> tuple[TrainerGroupObject | None, str]:
    """One watch request: the first object version for which ``seen`` is true (else None) and
    the last resourceVersion seen. Raises TrainerGroupNotFound on DELETED and ApiException
    (410 included) on an ERROR event."""
    w = k8s_watch.Watch()  # type: ignore[no-untyped-call]
    stream = w.stream(  # type: ignore[no-untyped-call]
        custom.list_namespaced_custom_object,
        API_GROUP,
        API_VERSION,
        k8s_namespace,
        PLURAL,
        field_selector=f"metadata.name={name}",
        resource_version=resource_version,
        allow_watch_bookmarks=True,
        timeout_seconds=max(1, math.ceil(seconds)),
        _request_timeout=(REQUEST_TIMEOUT_S, seconds + REQUEST_TIMEOUT_S),
    )
    try:
        for event in stream:
            obj = cast(TrainerGroupObject, event.get("raw_object") or {})
            resource_version = str(
                (obj.get("metadata") or {}).get("resourceVersion") or resource_version
            )
            kind = event.get("type")
            if kind == "DELETED":
                raise TrainerGroupNotFound(f"TrainerGroup {k8s_namespace}/{name} was deleted")
            if kind in ("ADDED", "MODIFIED") and seen(obj):
                return obj, resource_version
    finally:
        w.stop()  # type: ignore[no-untyped-call]
    return None, resource_version


def wait_until(
    *,
    name: str,
    done: Callable[[TrainerGroupObject], bool],
    timeout_s: float,
    k8s_namespace: str | None = None,
    kubeconfig: str | None = None,
    on_change: Callable[[TrainerGroupObject], None] | None = None,
    what: str = "the condition",
) -> TrainerGroupObject:
    """Watch the TrainerGroup until ``done(obj)``; that object version.

    ``on_change`` sees every version read (first the current one). Raises
    :class:`TrainerGroupNotFound` when it does not exist or is deleted, and
    :class:`TrainerGroupNotReady` (a TimeoutError) after ``timeout_s``.
    """
    ns = k8s_namespace or default_k8s_namespace(kubeconfig=kubeconfig)
    api = api_client(kubeconfig=kubeconfig)
    custom = k8s.CustomObjectsApi(api)
    deadline = time.monotonic() + timeout_s
    last: TrainerGroupObject | None = None

    def seen(obj: TrainerGroupObject) -> bool:
        nonlocal last
        last = obj
        if on_change is not None:
            on_change(obj)
        return done(obj)

    try:
        while True:
            current = _get(custom, k8s_namespace=ns, name=name)
            if seen(current):
                return current
            rv = str(current["metadata"]["resourceVersion"])
            try:
                while (left := deadline - time.monotonic()) > 0:
                    found, rv = _watch_once(
                        custom,
                        k8s_namespace=ns,
                        name=name,
                        resource_version=rv,
                        seconds=min(left, WATCH_CHUNK_S),
                        seen=seen,
                    )
                    if found is not None:
                        return found
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    continue  # our version is too old: read the object again, watch from there
                raise _forbidden(exc, k8s_namespace=ns, name=name) from exc
            st = parse_status((last or current).get("status"))
            raise TrainerGroupNotReady(
                f"TrainerGroup {ns}/{name}: {what} not reached after {timeout_s:g}s "
                f"(phase {st.phase or 'none yet'}: {st.message})",
                status=st,
            )
    finally:
        api.close()  # type: ignore[no-untyped-call]


def wait_for_ready(
    *,
    name: str,
    k8s_namespace: str | None = None,
    kubeconfig: str | None = None,
    timeout_s: float | None = None,
    on_progress: Callable[[TrainerGroupStatus], None] | None = None,
) -> ReadyGroup:
    """Watch until the TrainerGroup is Ready; its status and spec then.

    Raises :class:`TrainerGroupFailed` when the phase is Failed (for the current spec),
    :class:`TrainerGroupNotFound` when the object does not exist (or is deleted), and
    :class:`TrainerGroupNotReady` after ``timeout_s`` (default: the group's own Ready
    deadline, ``spec.timeouts`` clusterReadySeconds + workersReadySeconds). ``on_progress``
    is called whenever the phase or message changes.
    """
    ns = k8s_namespace or default_k8s_namespace(kubeconfig=kubeconfig)
    if timeout_s is None:
        first = get_trainergroup(name=name, k8s_namespace=ns, kubeconfig=kubeconfig)
        timeout_s = float(ready_deadline(first))
    shown: list[tuple[str, str]] = []

    def progress(obj: TrainerGroupObject) -> None:
        st = parse_status(obj.get("status"))
        if on_progress is not None and (not shown or shown[-1] != (st.phase, st.message)):
            shown.append((st.phase, st.message))
            on_progress(st)

    obj = wait_until(
        name=name,
        k8s_namespace=ns,
        kubeconfig=kubeconfig,
        timeout_s=timeout_s,
        done=lambda o: is_ready(o) or is_failed(o),
        on_change=progress,
        what="phase Ready",
    )
    st = parse_status(obj.get("status"))
    if not is_ready(obj):
        raise TrainerGroupFailed(f"TrainerGroup {ns}/{name} failed: {st.message}", status=st)
    return ReadyGroup(status=st, spec=parse_resource(obj).spec)
