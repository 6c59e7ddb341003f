"""The operator's I/O, as two small protocols: the Kubernetes API and a Ray dashboard.

The reconcile, teardown and deletion flows only talk to these. In the operator they
are :class:`tg_operator.kube.KubeApi` (served from kopf's indexes where it can,
see :class:`tg_operator.watched.WatchedKube`) and
:class:`tg_operator.dashboard.DashboardClient`; the unit tests use in-memory fakes
(tests/operator/fakes.py) that count every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from tg_operator.dashboard import ActorInfo, JobInfo


class KubeApi(Protocol):
    """TrainerGroup status writes, RayClusters and their pods."""

    async def patch_trainergroup_status(
        self, *, namespace: str, name: str, status: dict[str, Any]
    ) -> str | None:
        """Merge-patch the status; the object's new resourceVersion, None if it is gone."""
        ...

    async def remove_finalizer(
        self, *, namespace: str, name: str, finalizers: list[str], finalizer: str
    ) -> bool:
        """Drop ``finalizer`` from a TrainerGroup whose finalizers are ``finalizers``."""
        ...

    async def get_raycluster(self, *, namespace: str, name: str) -> dict[str, Any] | None: ...

    async def create_raycluster(self, body: dict[str, Any]) -> dict[str, Any] | None: ...

    async def delete_raycluster(self, *, namespace: str, name: str) -> bool: ...

    async def list_cluster_pods(self, *, namespace: str, cluster: str) -> list[dict[str, Any]]: ...

    async def list_workloads(self, *, namespace: str, cluster_uid: str) -> list[dict[str, Any]]:
        """Kueue's Workloads for the RayCluster with ``cluster_uid`` (none when Kueue's CRDs
        are not installed or the operator may not read them)."""
        ...

    async def workload_priority_class_exists(self, *, name: str) -> bool | None:
        """Whether Kueue's cluster-scoped WorkloadPriorityClass ``name`` exists (None: unknown,
        when Kueue's CRDs are not installed or the operator may not read them)."""
        ...

    async def get_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        """The PersistentVolumeClaim ``name`` (None: missing, or the operator may not read it)."""
        ...

    async def create_secret(self, body: dict[str, Any]) -> bool:
        """Create a Secret; False when it exists already (it is left as it is)."""
        ...

    async def create_networkpolicy(self, body: dict[str, Any]) -> bool:
        """Create a NetworkPolicy; False when it exists already."""
        ...

    async def get_tinker_deployment(
        self, *, namespace: str, group: str
    ) -> dict[str, Any] | None:
        """The group's Tinker server Deployment as the watch shows it (None: none)."""
        ...

    async def create_object(self, body: dict[str, Any]) -> bool:
        """Create a namespaced object of a kind ``tg_operator.tinker`` builds (ServiceAccount,
        Role, RoleBinding, Secret, Service, NetworkPolicy, Deployment); False if it exists."""
        ...

    async def update_deployment(self, body: dict[str, Any]) -> None:
        """Give an existing Deployment ``body``'s annotations and pod template (a JSON merge
        patch: the template's lists are replaced, not merged)."""
        ...


class Dashboard(Protocol):
    """The Ray Jobs and State APIs of one Ray cluster."""

    @property
    def base_url(self) -> str: ...

    async def version(self) -> dict[str, Any]: ...

    async def alive_worker_nodes(self) -> int: ...

    async def get_job(self, submission_id: str) -> JobInfo | None: ...

    async def submit_job(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        runtime_env: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> bool: ...

    async def stop_job(self, submission_id: str) -> bool: ...

    async def delete_job(self, submission_id: str) -> bool: ...

    async def job_logs(self, submission_id: str) -> str: ...

    async def list_actors(self, *, ray_namespace: str) -> list[ActorInfo]: ...

    async def node_log_file(self, *, node_id: str, filename: str, lines: int = 5) -> str | None: ...
