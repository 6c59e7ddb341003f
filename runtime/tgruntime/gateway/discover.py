"""The groups behind the gateway, read from the TrainerGroups themselves (``--trainergroups
NS``, or ``*`` for every namespace): each one whose ``status.apiURL`` is set, with the base
model names its spec serves (``spec.model.name``, its own name, ``spec.model.pretrained``)
and, on HTTPS, the CA its server is verified against (``spec.api.tls.caBundle``; none: the
image's public roots).
Listed every ``every_s`` seconds in a thread through the Kubernetes API (the pod's
ServiceAccount: get/list/watch on TrainerGroups, nothing else); a failed listing keeps the last
good list and says why in ``error`` (``/healthz``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from tgruntime.gateway.groups import Group

ALL = "*"


def groups_from_trainergroups(
    items: Iterable[Mapping[str, Any]], *, cluster: bool
) -> tuple[Group, ...]:
    """The serving groups of a TrainerGroup listing, by name (``<namespace>.<name>`` when the
    listing spans namespaces)."""
    out: list[Group] = []
    for tg in items:
        meta, spec = tg.get("metadata") or {}, tg.get("spec") or {}
        url = str((tg.get("status") or {}).get("apiURL") or "")
        if not url.startswith(("http://", "https://")) or meta.get("deletionTimestamp"):
            continue
        model = spec.get("model") or {}
        name = str(meta.get("name"))
        models = [str(m) for m in (model.get("name"), name, model.get("pretrained")) if m]
        tls = (spec.get("api") or {}).get("tls") or {}
        out.append(Group(
            name=f"{meta.get('namespace')}.{name}" if cluster else name,
            url=url.rstrip("/"), models=tuple(dict.fromkeys(models)),
            ca=str(tls.get("caBundle") or "") if url.startswith("https://") else "",
        ))
    return tuple(sorted(out, key=lambda g: g.name))


class TrainerGroupSource:
    """A group source (as gateway.groups.GroupSource) fed by a listing thread."""

    def __init__(self, *, namespace: str, every_s: float = 10.0) -> None:
        self.namespace, self.every_s = namespace, every_s
        self.error: str | None = "TrainerGroups not listed yet"
        self._groups: tuple[Group, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tg-discover", daemon=True)

    def start(self) -> TrainerGroupSource:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def groups(self) -> tuple[Group, ...]:
        return self._groups

    def _list(self) -> list[Mapping[str, Any]]:
        from kubernetes import client as k8s

        from tgapi.kube_view.kube import api_client

        custom: Any = k8s.CustomObjectsApi(api_client())  # answers plain dicts
        args = ("trainergroup.io", "v1alpha1")
        if self.namespace == ALL:
            got = custom.list_cluster_custom_object(*args, "trainergroups", _request_timeout=30)
        else:
            got = custom.list_namespaced_custom_object(
                *args, self.namespace, "trainergroups", _request_timeout=30
            )
        return list(got.get("items") or [])

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                items = self._list()
                self._groups = groups_from_trainergroups(items, cluster=self.namespace == ALL)
                self.error = None
            except Exception as exc:  # kept for /healthz; the last good list stays
                self.error = f"listing TrainerGroups in {self.namespace!r}: {exc}"[:500]
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))
