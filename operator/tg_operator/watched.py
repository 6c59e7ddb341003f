"""RayClusters and pods as kopf's watches see them (no list or get per pass).

kopf keeps two indexes filled from its watch streams (see :mod:`tg_operator.handlers`):
RayClusters by ``(namespace, name)`` and the pods KubeRay made by ``(namespace,
ray.io/cluster)``, and the Tinker servers' Deployments by ``(namespace, group)``.
:class:`WatchedKube` answers the reconcile's reads from them and
sends writes to the API server. A RayCluster the index does not hold yet (just
created, the watch event still on its way) is read with one GET.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tg_operator import names
from tg_operator.ports import KubeApi

Index = Mapping[Any, Iterable[Any]]
"""The shape of a ``kopf.Index``: key -> the values of every object with that key."""


def cluster_entry(*, namespace: str, name: str, body: Mapping[str, Any]) -> dict[Any, Any]:
    """What the RayCluster index keeps for one RayCluster."""
    return {(namespace, name): dict(body)}


def pod_entry(*, namespace: str, body: Mapping[str, Any]) -> dict[Any, Any]:
    """What the pod index keeps for one pod: its name, labels, deletion mark, conditions."""
    meta = body.get("metadata", {})
    labels = dict(meta.get("labels") or {})
    cluster = labels.get(names.RAY_CLUSTER_LABEL)
    if not cluster:
        return {}
    slim = {
        "metadata": {
            "name": meta.get("name"),
            "labels": labels,
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "status": {"conditions": list((body.get("status") or {}).get("conditions") or [])},
    }
    return {(namespace, cluster): slim}


class WatchedKube:
    """A :class:`~tg_operator.ports.KubeApi` reading RayClusters and pods from the indexes."""

    def __init__(
        self, *, api: KubeApi, clusters: Index, pods: Index, tinker: Index | None = None
    ) -> None:
        self._api = api
        self._clusters = clusters
        self._pods = pods
        self._tinker: Index = tinker if tinker is not None else {}

    async def patch_trainergroup_status(
        self, *, namespace: str, name: str, status: dict[str, Any]
    ) -> str | None:
        return await self._api.patch_trainergroup_status(
            namespace=namespace, name=name, status=status
        )

    async def remove_finalizer(
        self, *, namespace: str, name: str, finalizers: list[str], finalizer: str
    ) -> bool:
        return await self._api.remove_finalizer(
            namespace=namespace, name=name, finalizers=finalizers, finalizer=finalizer
        )

    async def get_raycluster(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        found = list(self._clusters.get((namespace, name), ()))
        if found:
            return dict(found[-1])
        return await self._api.get_raycluster(namespace=namespace, name=name)

    async def create_raycluster(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return await self._api.create_raycluster(body)

    async def delete_raycluster(self, *, namespace: str, name: str) -> bool:
        return await self._api.delete_raycluster(namespace=namespace, name=name)

    async def list_cluster_pods(self, *, namespace: str, cluster: str) -> list[dict[str, Any]]:
        return [dict(p) for p in self._pods.get((namespace, cluster), ())]

    async def list_workloads(self, *, namespace: str, cluster_uid: str) -> list[dict[str, Any]]:
        return await self._api.list_workloads(namespace=namespace, cluster_uid=cluster_uid)

    async def workload_priority_class_exists(self, *, name: str) -> bool | None:
        return await self._api.workload_priority_class_exists(name=name)

    async def get_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._api.get_claim(namespace=namespace, name=name)

    async def create_secret(self, body: dict[str, Any]) -> bool:
        return await self._api.create_secret(body)

    async def create_networkpolicy(self, body: dict[str, Any]) -> bool:
        return await self._api.create_networkpolicy(body)

    async def get_tinker_deployment(
        self, *, namespace: str, group: str
    ) -> dict[str, Any] | None:
        """From the Deployment index only: no GET (a Deployment created a moment ago and not
        yet in the index is created again, which answers "exists" and changes nothing)."""
        found = list(self._tinker.get((namespace, group), ()))
        return dict(found[-1]) if found else None

    async def create_object(self, body: dict[str, Any]) -> bool:
        return await self._api.create_object(body)

    async def update_deployment(self, body: dict[str, Any]) -> None:
        await self._api.update_deployment(body)
