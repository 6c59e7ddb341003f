"""The few Kubernetes API calls the operator makes, as async methods.

The ``kubernetes`` client is synchronous, so each call runs in a worker thread
(``asyncio.to_thread``) and the event loop that kopf drives never blocks. Reads of
RayClusters and pods come from kopf's watches (:mod:`tg_operator.watched`), so the
threads carry only the writes (status patches, RayCluster create/delete) and the
rare GET: the default pool (6 threads on 2 cores) is seldom busy. Objects
come back as plain wire-format dicts (camelCase), the same shape kopf hands to the
handlers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tg_operator import names, queue
from tgapi.kube_view.kube import api_client

__all__ = ["KubeApi", "api_client"]

class KubeApi:
    """TrainerGroups, RayClusters and pods, through one API client."""

    def __init__(self, client: k8s.ApiClient, *, request_timeout_s: float = 30.0) -> None:
        self._client = client
        self._custom = k8s.CustomObjectsApi(client)
        self._core = k8s.CoreV1Api(client)
        self._net = k8s.NetworkingV1Api(client)
        self._apps = k8s.AppsV1Api(client)
        self._rbac = k8s.RbacAuthorizationV1Api(client)
        self._timeout = request_timeout_s

    def close(self) -> None:
        self._client.close()  # type: ignore[no-untyped-call]

    # -- TrainerGroups --------------------------------------------------------------
    def get_trainergroup_sync(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_custom(names.GROUP, names.VERSION, names.TG_PLURAL, namespace, name)

    async def patch_trainergroup_status(
        self, *, namespace: str, name: str, status: dict[str, Any]
    ) -> str | None:
        """Merge-patch the status subresource; the new resourceVersion, None if gone."""

        def call() -> str | None:
            try:
                done: Any = self._custom.patch_namespaced_custom_object_status(
                    names.GROUP,
                    names.VERSION,
                    namespace,
                    names.TG_PLURAL,
                    name,
                    {"status": status},
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return str((done or {}).get("metadata", {}).get("resourceVersion") or "")

        return await asyncio.to_thread(call)

    async def remove_finalizer(
        self, *, namespace: str, name: str, finalizers: list[str], finalizer: str
    ) -> bool:
        """JSON-patch the finalizers to ``finalizers`` minus ``finalizer`` (a test op guards
        against a concurrent change); False if the object is gone or changed meanwhile."""
        if finalizer not in finalizers:
            return True
        patch = [
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {
                "op": "replace",
                "path": "/metadata/finalizers",
                "value": [f for f in finalizers if f != finalizer],
            },
        ]

        def call() -> bool:
            try:
                self._custom.patch_namespaced_custom_object(
                    names.GROUP,
                    names.VERSION,
                    namespace,
                    names.TG_PLURAL,
                    name,
                    patch,
                    _content_type="application/json-patch+json",
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status in (404, 409, 422):
                    return False
                raise
            return True

        return await asyncio.to_thread(call)

    # -- RayClusters ----------------------------------------------------------------
    async def get_raycluster(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(
            self._get_custom, names.RAY_GROUP, names.RAY_VERSION, names.RAY_PLURAL, namespace, name
        )

    async def create_raycluster(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create a RayCluster; None if one with that name already exists."""
        namespace = body["metadata"]["namespace"]

        def call() -> dict[str, Any] | None:
            try:
                created = self._custom.create_namespaced_custom_object(
                    names.RAY_GROUP,
                    names.RAY_VERSION,
                    namespace,
                    names.RAY_PLURAL,
                    body,
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status == 409:
                    return None
                raise
            return cast(dict[str, Any], created)

        return await asyncio.to_thread(call)

    async def delete_raycluster(self, *, namespace: str, name: str) -> bool:
        """Delete a RayCluster (background propagation); False if it was not there."""

        def call() -> bool:
            try:
                self._custom.delete_namespaced_custom_object(
                    names.RAY_GROUP,
                    names.RAY_VERSION,
                    namespace,
                    names.RAY_PLURAL,
                    name,
                    propagation_policy="Background",
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
            return True

        return await asyncio.to_thread(call)

    # -- pods -----------------------------------------------------------------------
    async def list_cluster_pods(self, *, namespace: str, cluster: str) -> list[dict[str, Any]]:
        """The pods KubeRay made for a RayCluster (label ``ray.io/cluster``)."""

        def call() -> list[dict[str, Any]]:
            resp: Any = self._core.list_namespaced_pod(
                namespace,
                label_selector=f"{names.RAY_CLUSTER_LABEL}={cluster}",
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            data = json.loads(resp.data)
            return list(data.get("items") or [])

        return await asyncio.to_thread(call)

    # -- the group's Secret and NetworkPolicy (tg_operator.ray_token, .networkpolicy) ---
    async def get_secret(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        def call() -> dict[str, Any] | None:
            try:
                resp: Any = self._core.read_namespaced_secret(
                    name, namespace, _preload_content=False, _request_timeout=self._timeout
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return cast(dict[str, Any], json.loads(resp.data))

        return await asyncio.to_thread(call)

    # -- the checkpoint claim (tg_operator.claims) ---------------------------------------
    async def get_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        """One GET of the PersistentVolumeClaim; None when it is missing or the operator holds
        no ``get`` on claims (an install whose RBAC predates the check: nothing is judged)."""

        def call() -> dict[str, Any] | None:
            try:
                resp: Any = self._core.read_namespaced_persistent_volume_claim(
                    name, namespace, _preload_content=False, _request_timeout=self._timeout
                )
            except ApiException as exc:
                if exc.status in (403, 404):
                    return None
                raise
            return cast(dict[str, Any], json.loads(resp.data))

        return await asyncio.to_thread(call)

    async def create_secret(self, body: dict[str, Any]) -> bool:
        """Create a Secret; False if one with that name already exists."""
        return await self._create(self._core.create_namespaced_secret, body)

    async def create_networkpolicy(self, body: dict[str, Any]) -> bool:
        """Create a NetworkPolicy; False if one with that name already exists."""
        return await self._create(self._net.create_namespaced_network_policy, body)

    # -- the Tinker server's objects (tg_operator.tinker) ------------------------------------
    async def get_tinker_deployment(
        self, *, namespace: str, group: str
    ) -> dict[str, Any] | None:
        """One GET of ``<group>-tinker``: for tools with the rights to read Deployments. The
        operator reads the watch's index instead (``WatchedKube``) and holds no ``get`` on
        Deployments: a 403 counts as "not seen" (the create that follows answers 409)."""

        def call() -> dict[str, Any] | None:
            try:
                resp: Any = self._apps.read_namespaced_deployment(
                    f"{group}-tinker",
                    namespace,
                    _preload_content=False,
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status in (403, 404):
                    return None
                raise
            return cast(dict[str, Any], json.loads(resp.data))

        return await asyncio.to_thread(call)

    async def create_object(self, body: dict[str, Any]) -> bool:
        """Create a ServiceAccount, Role, RoleBinding, Secret, Service, NetworkPolicy or
        Deployment; False if one with that name already exists (it is left as it is)."""
        methods = {
            "ServiceAccount": self._core.create_namespaced_service_account,
            "Secret": self._core.create_namespaced_secret,
            "Service": self._core.create_namespaced_service,
            "Role": self._rbac.create_namespaced_role,
            "RoleBinding": self._rbac.create_namespaced_role_binding,
            "NetworkPolicy": self._net.create_namespaced_network_policy,
            "Deployment": self._apps.create_namespaced_deployment,
        }
        return await self._create(methods[str(body["kind"])], body)

    async def apply_owned_deployment(self, body: dict[str, Any]) -> str:
        """Create the Deployment, or merge its owner references into the one that exists (the
        Tinker gateway: owned by every TrainerGroup of its namespace, tg_operator.gateway);
        its uid."""
        meta = body["metadata"]
        patch = {"metadata": {"ownerReferences": meta.get("ownerReferences")}}
        apps: Any = self._apps  # the client takes dict bodies (its stubs say models)

        def call() -> str:
            try:
                made = apps.create_namespaced_deployment(
                    meta["namespace"], body, _request_timeout=self._timeout
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                made = apps.patch_namespaced_deployment(
                    meta["name"], meta["namespace"], patch,
                    _content_type="application/merge-patch+json",
                    _request_timeout=self._timeout,
                )
            return str(made.metadata.uid)

        return await asyncio.to_thread(call)

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> None:
        """Set the Deployment's ``spec.replicas`` (a merge patch; nothing else changes)."""

        def call() -> None:
            self._apps.patch_namespaced_deployment(
                name, namespace, {"spec": {"replicas": replicas}},
                _content_type="application/merge-patch+json",
                _request_timeout=self._timeout,
            )

        await asyncio.to_thread(call)

    async def update_deployment(self, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        patch = {
            "metadata": {"annotations": meta.get("annotations") or {}},
            "spec": {"template": body["spec"]["template"]},
        }

        def call() -> None:
            self._apps.patch_namespaced_deployment(
                meta["name"],
                meta["namespace"],
                patch,
                _content_type="application/merge-patch+json",
                _request_timeout=self._timeout,
            )

        await asyncio.to_thread(call)

    async def _create(self, method: Any, body: dict[str, Any]) -> bool:
        namespace = body["metadata"]["namespace"]

        def call() -> bool:
            try:
                method(namespace, body, _request_timeout=self._timeout)
            except ApiException as exc:
                if exc.status == 409:
                    return False
                raise
            return True

        return await asyncio.to_thread(call)

    # -- plumbing -------------------------------------------------------------------
    async def list_workloads(self, *, namespace: str, cluster_uid: str) -> list[dict[str, Any]]:
        def call() -> list[dict[str, Any]]:
            try:
                found = self._custom.list_namespaced_custom_object(
                    queue.WORKLOAD_GROUP,
                    queue.WORKLOAD_VERSION,
                    namespace,
                    queue.WORKLOAD_PLURAL,
                    label_selector=f"{queue.JOB_UID_LABEL}={cluster_uid}",
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status in (403, 404):  # no Kueue here, or no RBAC for it: no message
                    return []
                raise
            return [dict(i) for i in cast(dict[str, Any], found).get("items") or []]

        return await asyncio.to_thread(call)

    async def workload_priority_class_exists(self, *, name: str) -> bool | None:
        def call() -> bool | None:
            try:
                self._custom.get_cluster_custom_object(
                    queue.WORKLOAD_GROUP,
                    queue.WORKLOAD_VERSION,
                    queue.PRIORITY_CLASS_PLURAL,
                    name,
                    _request_timeout=self._timeout,
                )
            except ApiException as exc:
                if exc.status == 404:
                    return False if _is_object_not_found(exc, name=name) else None  # no CRD: None
                if exc.status == 403:  # no RBAC (a namespaced install): unknown
                    return None
                raise
            return True

        return await asyncio.to_thread(call)

    def _get_custom(
        self, group: str, version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        try:
            obj = self._custom.get_namespaced_custom_object(
                group, version, namespace, plural, name, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return cast(dict[str, Any], obj)


def _is_object_not_found(exc: ApiException, *, name: str) -> bool:
    """A 404 for the named object (its Status names it), not for its resource type (an API
    server without the CRD answers "the server could not find the requested resource", with no
    name in its details)."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return False
    details = body.get("details") if isinstance(body, dict) else None
    return isinstance(details, dict) and details.get("name") == name
