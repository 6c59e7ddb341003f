"""In-memory stand-ins for the operator's two ports (Kubernetes API, Ray dashboard).

They play back what KubeRay and Ray would do, just enough for the reconcile's
decisions: a RayCluster that gets Ready pods when :meth:`FakeKube.make_ready` is
called, Ray jobs that finish as a script says, actors that live or die. Every
call is counted, so a test can bound the traffic a crash-looping group makes.
A :class:`FakeClock` is the operator's clock; tests move it instead of sleeping.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import datetime
from collections.abc import Mapping
from typing import Any

from tests.operator.helpers import body as tg_body
from tests.operator.helpers import pod
from tg_operator import names
from tg_operator.context import Context
from tg_operator.dashboard import ActorInfo, DashboardUnreachable, JobInfo
from tg_operator.settings import OperatorConfig
from tg_operator.status import rfc3339
from tgapi import SpecErrors, markers, parse_resource

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@dataclasses.dataclass
class RecordedEvents:
    """An EventSink that keeps the events in memory."""

    events: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def post(self, *, type: str, reason: str, message: str) -> None:
        self.events.append((type, reason, message))


@dataclasses.dataclass
class FakeClock:
    now: datetime.datetime = T0

    def __call__(self) -> datetime.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)


class FakeKube:
    """RayClusters and pods in memory; the TrainerGroup's status as last patched."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        """The API server's clock: the ``deletionTimestamp`` of a RayCluster with finalizers."""
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        """The Tinker server's objects by (kind, namespace, name)."""
        self.calls: collections.Counter[str] = collections.Counter()
        self.clusters: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.statuses: dict[tuple[str, str], dict[str, Any]] = {}
        self.released: list[tuple[str, str]] = []
        self.workloads: list[dict[str, Any]] = []
        """Kueue's Workloads (a test plays Kueue's part)."""
        self.priority_classes: set[str] | None = set()
        """Kueue's WorkloadPriorityClasses by name (None: unknown, no Kueue or no RBAC)."""
        self.watch_lags: set[tuple[str, str]] = set()
        """(namespace, group) whose Tinker Deployment the watch does not show yet."""
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        """PersistentVolumeClaims by (namespace, name) (a test plays the platform's part)."""

    async def patch_trainergroup_status(
        self, *, namespace: str, name: str, status: dict[str, Any]
    ) -> str | None:
        self.calls["patch_status"] += 1
        self.statuses[(namespace, name)] = copy.deepcopy(status)
        return str(self.calls["patch_status"])

    async def remove_finalizer(
        self, *, namespace: str, name: str, finalizers: list[str], finalizer: str
    ) -> bool:
        self.calls["remove_finalizer"] += 1
        self.released.append((namespace, name))
        return True

    async def list_workloads(self, *, namespace: str, cluster_uid: str) -> list[dict[str, Any]]:
        self.calls["list_workloads"] += 1
        return [
            copy.deepcopy(w)
            for w in self.workloads
            if w["metadata"].get("namespace") == namespace
            and w["metadata"].get("labels", {}).get("kueue.x-k8s.io/job-uid") == cluster_uid
        ]

    async def workload_priority_class_exists(self, *, name: str) -> bool | None:
        self.calls["workload_priority_class_exists"] += 1
        return None if self.priority_classes is None else name in self.priority_classes

    async def get_claim(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls["get_claim"] += 1
        found = self.claims.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def get_raycluster(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls["get_raycluster"] += 1
        found = self.clusters.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def create_raycluster(self, body: dict[str, Any]) -> dict[str, Any] | None:
        self.calls["create_raycluster"] += 1
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if key in self.clusters:
            return None
        self.clusters[key] = copy.deepcopy(body)
        return copy.deepcopy(body)

    async def delete_raycluster(self, *, namespace: str, name: str) -> bool:
        """Gone at once, or, while it has finalizers, kept with a ``deletionTimestamp``."""
        self.calls["delete_raycluster"] += 1
        self.pods.pop((namespace, name), None)
        rc = self.clusters.get((namespace, name))
        if rc is not None and rc["metadata"].get("finalizers"):
            rc["metadata"].setdefault("deletionTimestamp", rfc3339(self.clock()))
            return True
        return self.clusters.pop((namespace, name), None) is not None

    def drop_finalizers(self, namespace: str, name: str) -> None:
        """A controller's part (KubeRay's Redis cleanup done): a deleted RayCluster goes."""
        rc = self.clusters[(namespace, name)]
        rc["metadata"]["finalizers"] = []
        if rc["metadata"].get("deletionTimestamp"):
            del self.clusters[(namespace, name)]

    async def list_cluster_pods(self, *, namespace: str, cluster: str) -> list[dict[str, Any]]:
        self.calls["list_pods"] += 1
        return copy.deepcopy(self.pods.get((namespace, cluster), []))

    async def create_secret(self, body: dict[str, Any]) -> bool:
        self.calls["create_secret"] += 1
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        fresh = key not in self.secrets
        self.secrets.setdefault(key, copy.deepcopy(body))
        return fresh

    async def create_networkpolicy(self, body: dict[str, Any]) -> bool:
        self.calls["create_networkpolicy"] += 1
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        fresh = key not in self.policies
        self.policies.setdefault(key, copy.deepcopy(body))
        return fresh

    async def get_tinker_deployment(self, *, namespace: str, group: str) -> dict[str, Any] | None:
        self.calls["tinker_index"] += 1  # the operator reads it from the Deployment watch
        if (namespace, group) in self.watch_lags:
            return None
        found = self.objects.get(("Deployment", namespace, f"{group}-tinker"))
        return copy.deepcopy(found) if found is not None else None

    async def create_object(self, body: dict[str, Any]) -> bool:
        self.calls[f"create_{str(body['kind']).lower()}"] += 1
        key = (str(body["kind"]), body["metadata"]["namespace"], body["metadata"]["name"])
        fresh = key not in self.objects
        self.objects.setdefault(key, copy.deepcopy(body))
        return fresh

    async def update_deployment(self, body: dict[str, Any]) -> None:
        self.calls["update_deployment"] += 1
        key = ("Deployment", body["metadata"]["namespace"], body["metadata"]["name"])
        dep = self.objects[key]  # KeyError: an update of a Deployment that does not exist
        dep["metadata"]["annotations"] = dict(body["metadata"]["annotations"])
        dep["spec"]["template"] = copy.deepcopy(body["spec"]["template"])

    def make_tinker_available(self, namespace: str, group: str) -> None:
        """The Deployment controller's part: the Tinker server's pod is available."""
        dep = self.objects[("Deployment", namespace, f"{group}-tinker")]
        dep["status"] = {
            "availableReplicas": 1,
            "conditions": [{"type": "Available", "status": "True"}],
        }

    def make_ready(self, namespace: str, name: str, *, workers: int = 1) -> None:
        """KubeRay's part: the pods are Ready and the cluster is provisioned."""
        rc = self.clusters[(namespace, name)]
        rc["status"] = {"conditions": [{"type": "RayClusterProvisioned", "status": "True"}]}
        self.pods[(namespace, name)] = [pod(f"{name}-head", node_type="head")] + [
            pod(f"{name}-worker-{i}", node_type="worker") for i in range(workers)
        ]

    def foreign_cluster(self, namespace: str, name: str) -> None:
        self.clusters[(namespace, name)] = {
            "metadata": {"name": name, "namespace": namespace, "ownerReferences": []},
            "spec": {"workerGroupSpecs": []},
        }


@dataclasses.dataclass
class Script:
    """How the fake Ray answers: the server job's end, the teardown reports, the actors."""

    server_status: str = "SUCCEEDED"
    server_runs: bool = False
    """The server job stays RUNNING (never reports)."""
    teardown_reports: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One report per teardown job, in order; when empty, a complete teardown."""
    workers_die: bool = False
    """Every group's actors are DEAD as soon as they exist (a crash loop)."""
    reachable: bool = True


NODE = "node-a"
"""The Ray node every fake actor runs on."""


class FakeRay:
    """The Jobs and State APIs of one Ray cluster, in memory."""

    def __init__(self, clock: FakeClock, *, url: str = "http://ray.invalid:8265") -> None:
        self.base_url = url
        self.clock = clock
        self.script = Script()
        self.calls: collections.Counter[str] = collections.Counter()
        self.jobs: dict[str, JobInfo] = {}
        self.logs: dict[str, str] = {}
        self.actors: dict[str, ActorInfo] = {}
        self.files: dict[tuple[str, str], str] = {}
        """(node id, filename under the Ray log dir) -> text: rank 0's progress file."""
        self.ray_namespace = ""
        # the ALIVE non-head nodes Ray sees (default: more than any test's RayCluster asks)
        self.worker_nodes = 64

    def _check(self, what: str) -> None:
        self.calls[what] += 1
        if not self.script.reachable:
            raise DashboardUnreachable(url=self.base_url, message="connection refused")

    async def version(self) -> dict[str, Any]:
        self._check("version")
        return {"ray_version": "2.60.0"}

    async def alive_worker_nodes(self) -> int:
        self._check("alive_worker_nodes")
        return self.worker_nodes

    async def get_job(self, submission_id: str) -> JobInfo | None:
        self._check("get_job")
        return self.jobs.get(submission_id)

    async def submit_job(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        runtime_env: Mapping[str, Any] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> bool:
        self._check("submit_job")
        if submission_id in self.jobs:
            return False
        start = int(self.clock().timestamp() * 1000)
        if "-teardown-" in submission_id:
            report: dict[str, Any] = (
                self.script.teardown_reports.pop(0)
                if self.script.teardown_reports
                else {"complete": True, "errors": []}
            )
            status = "SUCCEEDED" if report.get("complete") else "FAILED"
            teardown = markers.Teardown(
                group_name="g",
                ray_namespace=self.ray_namespace,
                complete=bool(report.get("complete")),
                errors=tuple(str(e) for e in report.get("errors") or ()),
            )
            self.logs[submission_id] = f"{markers.line(teardown)}\n"
            if report.get("complete"):
                for name, a in self.actors.items():
                    self.actors[name] = dataclasses.replace(a, state="DEAD")
        elif self.script.server_runs:
            status = "RUNNING"
        else:
            status = self.script.server_status
            gen = int(submission_id.rsplit("-g", 1)[1])
            workers = [f"w{gen}-{r}" for r in range(2)]
            record = markers.GroupReady(
                group_name="g",
                ray_namespace=self.ray_namespace,
                generation=gen,
                worker_names=tuple(workers),
                world_size=2,
                mesh={"tp": 1, "pp": 1, "cp": 1, "dp": 2},
            )
            self.logs[submission_id] = f"{markers.line(record)}\n"
            state = "DEAD" if self.script.workers_die else "ALIVE"
            for w in workers:
                cause = "exit 1" if state == "DEAD" else ""
                self.actors[w] = ActorInfo(
                    actor_id=f"id-{w}", name=w, state=state, death_cause=cause, node_id=NODE
                )
        self.jobs[submission_id] = JobInfo(
            submission_id=submission_id, status=status, start_time_ms=start
        )
        return True

    async def stop_job(self, submission_id: str) -> bool:
        self._check("stop_job")
        job = self.jobs.get(submission_id)
        if job is None:
            return False
        self.jobs[submission_id] = dataclasses.replace(job, status="STOPPED")
        return True

    async def delete_job(self, submission_id: str) -> bool:
        self._check("delete_job")
        return self.jobs.pop(submission_id, None) is not None

    async def job_logs(self, submission_id: str) -> str:
        self._check("job_logs")
        return self.logs.get(submission_id, "")

    async def list_actors(self, *, ray_namespace: str) -> list[ActorInfo]:
        self._check("list_actors")
        return list(self.actors.values())

    async def node_log_file(self, *, node_id: str, filename: str, lines: int = 5) -> str | None:
        self._check("node_log_file")
        return self.files.get((node_id, filename))

    def kill(self, name: str, cause: str = "the worker process died") -> None:
        self.actors[name] = dataclasses.replace(self.actors[name], state="DEAD", death_cause=cause)


@dataclasses.dataclass
class World:
    """A context wired to the fakes, and one TrainerGroup body."""

    clock: FakeClock
    kube: FakeKube
    ray: FakeRay
    ctx: Context
    obj: dict[str, Any]
    sink: RecordedEvents

    @property
    def status(self) -> dict[str, Any]:
        meta = self.obj["metadata"]
        return self.kube.statuses.get((meta["namespace"], meta["name"]), {})

    def warnings(self) -> list[tuple[str, str, str]]:
        return [e for e in self.sink.events if e[0] == "Warning"]

    def reasons(self) -> list[str]:
        return [e[1] for e in self.sink.events]


def world(*, env: Mapping[str, str] | None = None, **spec: Any) -> World:
    clock = FakeClock()
    kube = FakeKube(clock)
    ray = FakeRay(clock)
    base = {"HOME": "/nonexistent", "TG_RAY_TOKEN_KEY": "fake-key"}
    config = OperatorConfig.from_env({**base, **(env or {})})
    ctx = Context(config=config, kube=kube, dashboards=lambda url, token: ray, clock=clock)
    obj = tg_body(**spec)
    tg = parse_resource(obj)
    ray.ray_namespace = tg.ray_namespace
    ray.base_url = config.dashboard_url(cluster=names.cluster_name(tg), namespace=tg.namespace)
    return World(clock=clock, kube=kube, ray=ray, ctx=ctx, obj=obj, sink=RecordedEvents())


def cluster_key(w: World) -> tuple[str, str]:
    try:
        tg = parse_resource(w.obj)
    except SpecErrors:
        return ("", "")
    return (tg.namespace, names.cluster_name(tg))
