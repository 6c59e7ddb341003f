"""``spec.queue`` against a real API server and the real KubeRay operator (local control plane):
the RayCluster is created suspended and labelled for Kueue, KubeRay starts no pod for it, the
group is Queued (never Failed, no cluster timeout) with the Workload's admission message, and
once the cluster is admitted (``spec.suspend: false``, what Kueue's RayCluster integration
does) the group becomes Ready.

Kueue's Workload CRD comes from Kueue's own module (hack/kueue/source.sh); the test writes the
Workload that Kueue's controller would (running Kueue itself is the kind suite's part,
docs/kueue.md).
"""

from __future__ import annotations

import copy
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hack import operator_plane as ks
from tests.operator.test_k8s_operator import READY_TIMEOUT, delete_and_wait
from tg_operator import queue

pytestmark = [pytest.mark.k8s, pytest.mark.ray]
REPO = Path(__file__).resolve().parents[2]


def _kueue_workload_crd() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "kueue" / "source.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"hack/kueue/source.sh failed: {proc.stderr[-2000:]}")
    src = Path(proc.stdout.strip().splitlines()[-1])
    return src / "config" / "components" / "crd" / "bases" / "kueue.x-k8s.io_workloads.yaml"


def _workload(ns: str, *, cluster_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{queue.WORKLOAD_GROUP}/{queue.WORKLOAD_VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": "raycluster-queued-test",
            "namespace": ns,
            "labels": {queue.JOB_UID_LABEL: cluster_uid},
        },
        "spec": {
            "queueName": "team-a",
            "podSets": [
                {
                    "name": "head",
                    "count": 1,
                    "template": {"spec": {"containers": [{"name": "ray-head", "image": "x"}]}},
                }
            ],
        },
    }


def test_a_queued_group_waits_suspended_then_starts_once_admitted(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    crd = _kueue_workload_crd()
    k8s_plane.kubectl("apply", "--server-side", "-f", str(crd))  # too big for client-side apply

    def established() -> bool:
        crd_obj = k8s_plane.kubectl_json("get", "crd", "workloads.kueue.x-k8s.io")
        conds = crd_obj.get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

    ks.wait_for(established, timeout=60, what="Kueue's Workload CRD to be established")
    name = "queued"
    k8s_plane.apply(ks.noop(name, ns, queue={"name": "team-a", "priorityClass": "high"}))

    st = ks.wait_phase(k8s_plane, ns, name, {"Queued"}, timeout=120, op=operator)
    assert "no Workload yet" in st["message"], st["message"]
    rc = k8s_plane.kubectl_json("get", "raycluster", name, "-n", ns)
    assert rc["spec"]["suspend"] is True
    labels = rc["metadata"]["labels"]
    assert labels[queue.QUEUE_LABEL] == "team-a" and labels[queue.PRIORITY_LABEL] == "high"

    # Kueue's Workload for the cluster, not admitted: its message reaches the status
    body = _workload(ns, cluster_uid=rc["metadata"]["uid"])
    k8s_plane.apply(body)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    why = "couldn't assign flavors to pod set head: insufficient quota for nvidia.com/gpu"
    k8s_plane.kubectl(
        "patch",
        "workload",
        body["metadata"]["name"],
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"conditions": [{"type": "QuotaReserved", "status": "False", '
        f'"reason": "Pending", "message": "{why}", "lastTransitionTime": "{now}"}}]}}}}',
    )

    st = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: why in s.get("message", ""),
        timeout=60,
        what="the admission message",
        op=operator,
    )
    assert st["phase"] == "Queued" and "Workload raycluster-queued-test" in st["message"]
    pods = k8s_plane.kubectl_json("get", "pods", "-n", ns, "-l", f"ray.io/cluster={name}")
    assert pods["items"] == [], "a queued group must have no pod (no partial placement)"
    rc = k8s_plane.kubectl_json("get", "raycluster", name, "-n", ns)
    assert rc["spec"]["suspend"] is True  # the operator never unsuspends
    warnings = [
        (e["involvedObject"].get("kind"), e.get("source", {}).get("component"), e["reason"],
         e.get("message"))
        for e in ks.events_of(k8s_plane, ns, name) if e.get("type") == "Warning"
    ]
    assert warnings == [], warnings

    # admitted: Kueue clears spec.suspend; KubeRay starts the pods; the group becomes Ready
    k8s_plane.kubectl(
        "patch", "raycluster", name, "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}'
    )
    st = ks.wait_phase(k8s_plane, ns, name, {"Ready", "Failed"}, timeout=READY_TIMEOUT, op=operator)
    assert st["phase"] == "Ready", ks.dump(st)
    # the gauge follows the status write (same pass, after it): wait for it, bounded
    gauge = f'trainergroup_phase{{name="{name}",namespace="{ns}",phase="Ready"}} 1.0'
    ks.wait_for(lambda: gauge in operator.metrics(), timeout=30, what=gauge)
    delete_and_wait(k8s_plane, ns, name, operator)


def test_gang_scheduling_fields_land_on_the_real_pods(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    """Without Kueue: the gang-scheduling labels reach the RayCluster and ``schedulerName`` and
    the pod labels reach every pod KubeRay creates (docs/kueue.md, "Gang scheduling"). No
    Volcano runs here, so the pods stay Pending; the group waits for its cluster, not Failed."""
    name = "gang"
    cluster = copy.deepcopy(ks.TINY_SPEC["rayCluster"])
    gang = {"ray.io/gang-scheduling-enabled": "true", "volcano.sh/queue-name": "team-a"}
    pod_labels = {"yunikorn.apache.org/app-id": "gang-app"}
    cluster.update(schedulerName="volcano", labels=gang, podLabels=pod_labels)
    k8s_plane.apply(ks.noop(name, ns, rayCluster=cluster))

    def pods() -> list[dict[str, Any]] | None:
        got = k8s_plane.kubectl_json("get", "pods", "-n", ns, "-l", f"ray.io/cluster={name}")
        items: list[dict[str, Any]] = got["items"]
        return items if len(items) == 2 else None  # the head and the one worker

    items = ks.wait_for(
        pods, timeout=120, what="KubeRay's head and worker pods", detail=operator.tail
    )
    for pod in items:
        assert pod["spec"]["schedulerName"] == "volcano", pod["metadata"]["name"]
        assert pod_labels.items() <= pod["metadata"]["labels"].items(), pod["metadata"]
        assert pod["status"].get("phase") == "Pending"  # no Volcano: nothing binds them
    rc = k8s_plane.kubectl_json("get", "raycluster", name, "-n", ns)
    assert gang.items() <= rc["metadata"]["labels"].items(), rc["metadata"]["labels"]
    assert ks.status_of(k8s_plane, ns, name).get("phase") not in {"Failed", "Ready"}
    delete_and_wait(k8s_plane, ns, name, operator)
