"""``spec.queue``: the RayCluster is created suspended for Kueue, and a suspended cluster is
Queued, never a failure (pure builders, and the reconcile flow on the in-memory ports; the
test plays Kueue's part by flipping ``spec.suspend`` as Kueue does on admission/preemption)."""

from __future__ import annotations

from typing import Any, cast

from kubernetes.client import CustomObjectsApi

from tests.operator.fakes import World, cluster_key, world
from tests.operator.helpers import body
from tests.operator.test_reconcile_flow import drive, phase_is, run
from tg_operator import decide, queue, raycluster, reconcile, spec_change
from tgapi import parse_resource


def _queued_body(**queue_spec: str) -> dict[str, Any]:
    b = body()
    b["spec"]["queue"] = {"name": "team-a", **queue_spec}
    return b


def test_a_queued_group_s_cluster_is_suspended_and_labelled() -> None:
    tg = parse_resource(_queued_body(priorityClass="high"))
    rc = raycluster.build_raycluster(tg, cluster_hash="h")
    assert rc["spec"]["suspend"] is True
    labels = rc["metadata"]["labels"]
    assert labels[queue.QUEUE_LABEL] == "team-a" and labels[queue.PRIORITY_LABEL] == "high"
    plain = raycluster.build_raycluster(parse_resource(body()), cluster_hash="h")
    assert "suspend" not in plain["spec"] and queue.QUEUE_LABEL not in plain["metadata"]["labels"]


def test_the_queue_is_part_of_the_cluster_hash_only_when_set() -> None:
    plain, queued = parse_resource(body()).spec, parse_resource(_queued_body()).spec
    assert spec_change.cluster_hash(plain) != spec_change.cluster_hash(queued)
    b = body()
    b["spec"]["rayCluster"]["schedulerName"] = ""  # a later field at its default: same hash
    assert spec_change.cluster_hash(parse_resource(b).spec) == spec_change.cluster_hash(plain)


def test_scheduler_name_and_gang_labels_pass_through_to_the_cluster_and_its_pods() -> None:
    b = body()
    b["spec"]["rayCluster"]["schedulerName"] = "volcano"
    b["spec"]["rayCluster"]["labels"] = {"ray.io/gang-scheduling-enabled": "true"}
    rc = raycluster.build_raycluster(parse_resource(b), cluster_hash="h")
    assert rc["metadata"]["labels"]["ray.io/gang-scheduling-enabled"] == "true"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    worker = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert head["schedulerName"] == "volcano" and worker["schedulerName"] == "volcano"


def test_admission_message_uses_kueue_s_words() -> None:
    workload = {
        "metadata": {"name": "raycluster-demo-3f2a1"},
        "status": {
            "conditions": [
                {
                    "type": "QuotaReserved",
                    "status": "False",
                    "message": "couldn't assign flavors to pod set workers: insufficient "
                    "quota for nvidia.com/gpu in flavor default",
                }
            ]
        },
    }
    msg = queue.admission_message(workload, queue="team-a")
    assert msg.startswith("waiting in Kueue LocalQueue team-a (Workload raycluster-demo-3f2a1): ")
    assert "insufficient quota for nvidia.com/gpu" in msg
    assert "no Workload yet" in queue.admission_message(None, queue="team-a")


def _kueue(w: World, *, admit: bool) -> None:
    """Kueue's part: admission clears spec.suspend, preemption sets it (KubeRay then deletes
    the pods)."""
    rc = w.kube.clusters[cluster_key(w)]
    rc["spec"]["suspend"] = not admit
    if not admit:
        w.kube.pods.pop(cluster_key(w), None)
        rc["status"] = {"state": "suspended"}


def _drive_queued(w: World, passes: int) -> None:
    """Passes with KubeRay making no pods for a suspended cluster."""
    for _ in range(passes):
        key = cluster_key(w)
        rc = w.kube.clusters.get(key)
        run(drive(w, passes=1, kuberay=rc is not None and not queue.suspended(rc)))


def test_a_queued_group_waits_without_timing_out_then_starts_once_admitted() -> None:
    w = world()
    w.obj["spec"]["queue"] = {"name": "team-a"}
    w.obj["spec"].setdefault("timeouts", {})["clusterReadySeconds"] = 60
    _drive_queued(w, passes=3)
    key = cluster_key(w)
    w.kube.clusters[key].setdefault("metadata", {})["uid"] = "rc-uid-1"
    w.kube.workloads.append(
        {
            "metadata": {
                "name": "raycluster-x-1",
                "namespace": key[0],
                "labels": {queue.JOB_UID_LABEL: "rc-uid-1"},
            },
            "status": {
                "conditions": [
                    {
                        "type": "QuotaReserved",
                        "status": "False",
                        "message": "insufficient quota for nvidia.com/gpu",
                    }
                ]
            },
        }
    )
    for _ in range(20):  # far past clusterReadySeconds
        _drive_queued(w, passes=1)
        w.clock.advance(30)
    st = w.status
    assert st["phase"] == "Queued", st
    assert "Workload raycluster-x-1" in st["message"] and "insufficient quota" in st["message"]
    assert w.kube.clusters[key]["spec"]["suspend"] is True  # never unsuspended by the operator
    assert w.ray.calls["submit_job"] == 0 and w.warnings() == []
    assert w.kube.calls["delete_raycluster"] == 0
    tinker_key = ("Deployment", key[0], f"{w.obj['metadata']['name']}-tinker")
    assert tinker_key not in w.kube.objects  # a queued group holds no pod, not even its server
    # far past clusterReadySeconds, a queued group still waits for the watch (no 1 s poll,
    # which would list Workloads every second)
    step = run(reconcile.advance(w.ctx, obj=w.obj, sink=w.sink))
    assert step.delay == decide.WATCH_FALLBACK_S, step

    _kueue(w, admit=True)
    run(drive(w, until=phase_is("Ready")))
    assert w.status["phase"] == "Ready" and w.status["readyWorkers"] == 2
    assert tinker_key in w.kube.objects  # admitted: the Tinker server is created


def test_a_missing_priority_class_is_named_with_the_fix_and_the_group_stays_queued() -> None:
    """Kueue makes no Workload (and posts no event) for a RayCluster whose priority class does
    not exist: the status says so, names the field and the fix, and stays Queued; nothing
    beyond the suspended cluster is created. Once the class exists and Kueue admits the
    cluster, the group starts."""
    w = world()
    w.obj["spec"]["queue"] = {"name": "team-a", "priorityClass": "no-such-class"}
    w.obj["spec"].setdefault("timeouts", {})["clusterReadySeconds"] = 60
    for _ in range(10):  # far past clusterReadySeconds
        _drive_queued(w, passes=1)
        w.clock.advance(30)
    st = w.status
    assert st["phase"] == "Queued", st
    assert st["message"] == (
        "waiting for Kueue: WorkloadPriorityClass no-such-class does not exist, so Kueue makes "
        "no Workload for this RayCluster (LocalQueue team-a); create the WorkloadPriorityClass "
        "or change spec.queue.priorityClass"
    ), st["message"]
    key = cluster_key(w)
    assert w.kube.clusters[key]["spec"]["suspend"] is True
    assert w.kube.calls["create_raycluster"] == 1 and w.kube.calls["delete_raycluster"] == 0
    tinker_key = ("Deployment", key[0], f"{w.obj['metadata']['name']}-tinker")
    assert tinker_key not in w.kube.objects
    assert w.ray.calls["submit_job"] == 0 and w.warnings() == []

    # the admin creates the class: no Workload yet, today's message; then Kueue admits it
    assert w.kube.priority_classes is not None
    w.kube.priority_classes.add("no-such-class")
    _drive_queued(w, passes=1)
    assert w.status["phase"] == "Queued" and "no Workload yet" in w.status["message"]
    _kueue(w, admit=True)
    run(drive(w, until=phase_is("Ready")))
    assert w.status["phase"] == "Ready"


def test_an_existing_or_unknown_priority_class_keeps_the_no_workload_message() -> None:
    for classes in ({"high"}, None):  # None: no Kueue CRD, or no RBAC (a namespaced install)
        w = world()
        w.obj["spec"]["queue"] = {"name": "team-a", "priorityClass": "high"}
        w.kube.priority_classes = classes
        _drive_queued(w, passes=3)
        assert w.status["phase"] == "Queued", w.status
        assert w.status["message"] == (
            "waiting for Kueue to admit the RayCluster (LocalQueue team-a; no Workload yet)"
        )
        assert w.kube.calls["workload_priority_class_exists"] >= 1
    # no priority class named: nothing to read
    w = world()
    w.obj["spec"]["queue"] = {"name": "team-a"}
    _drive_queued(w, passes=3)
    assert "no Workload yet" in w.status["message"]
    assert w.kube.calls["workload_priority_class_exists"] == 0
    # a Workload exists: its words win over a missing class
    assert "Workload raycluster-x" in queue.admission_message(
        {"metadata": {"name": "raycluster-x"}},
        queue="team-a",
        priority_class="gone",
        priority_class_exists=False,
    )


def test_a_preempted_group_goes_back_to_queued_then_resumes_once_admitted_again() -> None:
    w = world()
    w.obj["spec"]["queue"] = {"name": "team-a"}
    _drive_queued(w, passes=2)
    _kueue(w, admit=True)
    run(drive(w, until=phase_is("Ready")))
    first = w.status["groupGeneration"]

    _kueue(w, admit=False)  # preempted by a higher-priority workload
    _drive_queued(w, passes=3)
    assert w.status["phase"] == "Queued" and w.status["readyWorkers"] == 0
    assert not [e for e in w.warnings() if e[1] == "Failed"]

    _kueue(w, admit=True)
    for name in list(w.ray.actors):  # the old head went with its pod: its actors are gone
        w.ray.kill(name, cause="the node was removed")
    run(
        drive(
            w,
            until=lambda x: (
                x.status.get("phase") == "Ready" and x.status.get("groupGeneration", 0) > first
            ),
        )
    )
    assert w.status["phase"] == "Ready" and w.status["groupGeneration"] == first + 1


def test_the_real_port_tells_a_missing_class_from_a_missing_kueue() -> None:
    """kube.KubeApi: a 404 naming the object is "does not exist"; a 404 for the resource type
    (no Kueue CRD) or a 403 (no RBAC, e.g. a watched-namespaces install) is unknown (None)."""
    import json

    from kubernetes.client.exceptions import ApiException

    from tg_operator import kube

    def raising(status: int, details: dict[str, Any] | None) -> Any:
        class Custom:
            def get_cluster_custom_object(self, *args: Any, **kwargs: Any) -> Any:
                assert args[:3] == ("kueue.x-k8s.io", "v1beta2", "workloadpriorityclasses")
                if status == 200:
                    return {"metadata": {"name": args[3]}}
                exc = ApiException(status=status)
                exc.body = json.dumps({"kind": "Status", "code": status, "details": details})
                raise exc

        api = object.__new__(kube.KubeApi)
        api._custom = cast(CustomObjectsApi, Custom())  # the one method the code calls
        api._timeout = 1.0
        return api

    def exists(api: Any) -> bool | None:
        return run(api.workload_priority_class_exists(name="no-such-class"))  # type: ignore[no-any-return]

    gone = {"name": "no-such-class", "group": "kueue.x-k8s.io", "kind": "workloadpriorityclasses"}
    assert exists(raising(404, gone)) is False
    assert exists(raising(404, None)) is None  # "the server could not find the requested resource"
    assert exists(raising(403, gone)) is None
    assert exists(raising(200, None)) is True
