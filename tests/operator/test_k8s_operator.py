"""The operator against a real API server (local control plane) and a real local Ray.

The operator runs as ``python -m tg_operator`` with a ServiceAccount holding exactly
``tg_operator.rbac.OPERATOR_RULES`` (RBAC is on), watching one namespace; the Ray
side is the local Ray (dashboard/GCS overrides). Pods are kwok's, so the RayCluster
is real to Kubernetes (scheduled on the fake GPU node, Ready) while the workers run
in the local Ray.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tgapi.kube_view
from hack import operator_plane as ks
from tests.operator.conftest import RayEndpoint
from tg_operator import rbac

pytestmark = [pytest.mark.k8s, pytest.mark.ray]
READY_TIMEOUT = 900.0
BACKOFF_S = 4
"""The restart back-off of this module's operator (10 s by default): only the crash-loop test
restarts a group twice; every other restart here is a first one, which runs at once."""
OPERATOR_ENV = {"TG_RESTART_BACKOFF_SECONDS": str(BACKOFF_S)}
HEALTH_INTERVAL_S = 2.0
"""The operator's health tick here (hack/operator_plane.operator_env's default)."""


def delete_and_wait(
    plane: Any, ns: str, name: str, op: ks.OperatorProcess, timeout: float = 300
) -> None:
    plane.kubectl("delete", "trainergroup", name, "-n", ns, "--wait=false", check=False)
    ks.wait_gone(plane, ns, name, timeout=timeout, op=op)


# -- the API server rejects what its schema can ------------------------------------------
@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (
            lambda s: s["parallelism"].update(tensor=3),
            "does not divide the world size",
        ),
        (
            lambda s: s["model"].update(numAttentionHeads=3),
            "is not divisible by numAttentionHeads",
        ),
        (lambda s: s.update(restartPolicy="Always"), "Unsupported value"),
        (
            lambda s: s["workers"].update(processesPerNode=[0]),
            "should be greater than or equal to 1",
        ),
        (
            lambda s: s.update(rayClusterRef={"name": "x"}),
            "set exactly one of rayCluster and rayClusterRef",
        ),
        (lambda s: s["rayCluster"]["workers"].update(cpu="lots"), "should match"),
    ],
    ids=["tp-divides-world", "heads-divide-hidden", "enum", "minimum", "cluster-xor", "quantity"],
)
def test_api_server_rejects_invalid_specs(
    k8s_plane: Any, ns: str, mutate: Any, needle: str
) -> None:
    ks.install_crd(k8s_plane)
    body = ks.trainergroup("rejected", ns)
    mutate(body["spec"])
    proc = k8s_plane.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert proc.returncode != 0, proc.stdout
    assert needle in proc.stderr, proc.stderr
    assert ks.get_tg(k8s_plane, ns, "rejected") is None


# -- what only the operator can check: Failed, with the field and the fix, nothing created --
def test_invalid_spec_ends_failed_and_creates_nothing(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess, ray_endpoint: RayEndpoint
) -> None:
    # Every rule, the size estimate included, is refused at admission when the chart's
    # ValidatingAdmissionPolicy is installed (tests/k8s/test_admission.py). This plane has
    # the CRD only (install_crd), as a cluster without the policy would: the operator's own
    # parse must refuse the model (tgapi.sizing): 1.07B parameters, two CPU processes per
    # 4Gi pod at 16 bytes per parameter each.
    body = ks.noop("badexpert", ns)
    body["spec"]["model"].update(hiddenSize=1024, numLayers=64, ffnHiddenSize=4096)
    k8s_plane.apply(body)
    st = ks.wait_phase(k8s_plane, ns, "badexpert", {"Failed"}, timeout=120, op=operator)
    assert "spec.rayCluster.workers.memory: 4Gi is too small for the model" in st["message"]
    assert "1.07B parameters" in st["message"], st["message"]
    assert "fix: set rayCluster.workers.memory to at least 17Gi" in st["message"]
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["WorkersReady"]["reason"] == "InvalidSpec"
    assert (
        k8s_plane.kubectl("get", "raycluster", "badexpert", "-n", ns, check=False).returncode != 0
    )
    assert ks.ray_jobs(ray_endpoint.dashboard_url, f"tg-{ns}-badexpert-") == []
    # The events are posted after the status write (kopf posts them in the background): wait.
    def reasons() -> set[str]:
        return {e["reason"] for e in ks.events_of(k8s_plane, ns, "badexpert")}

    ks.wait_for(
        lambda: {"InvalidSpec", "Failed"} <= reasons(),
        timeout=60,
        what="the InvalidSpec and Failed events of badexpert",
        detail=lambda: f"events so far: {sorted(reasons())}",
    )

    # a client waiting for it (with the client's least-privilege account) is told why
    client = ks.grant(
        k8s_plane, namespace=ns, account="tg-client", rules=rbac.CLIENT_RULES, cluster_wide=False
    )
    with pytest.raises(
        tgapi.kube_view.TrainerGroupFailed, match=r"spec\.rayCluster\.workers\.memory"
    ):
        tgapi.kube_view.wait_for_ready(
            name="badexpert", k8s_namespace=ns, kubeconfig=str(client), timeout_s=30
        )
    with pytest.raises(tgapi.kube_view.TrainerGroupNotFound):
        tgapi.kube_view.wait_for_ready(
            name="nosuch", k8s_namespace=ns, kubeconfig=str(client), timeout_s=30
        )
    # ... and so is the client Job's `wait` step, on stderr with a non-zero exit
    proc = client_wait("badexpert", ns, client)
    assert (proc.returncode, proc.stdout) == (1, ""), proc
    assert "failed" in proc.stderr and "spec.rayCluster.workers.memory" in proc.stderr, proc.stderr
    delete_and_wait(k8s_plane, ns, "badexpert", operator, timeout=60)


def test_unschedulable_gpu_pod_is_reported_then_times_out(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    body = ks.noop("toobig", ns)
    body["spec"]["rayCluster"]["workers"]["gpusPerWorker"] = 16  # the node has 8
    body["spec"]["timeouts"]["clusterReadySeconds"] = 25
    k8s_plane.apply(body)

    st = ks.wait_status(
        k8s_plane,
        ns,
        "toobig",
        lambda s: "Insufficient nvidia.com/gpu" in s.get("message", ""),
        timeout=120,
        what="the scheduler's message in the status",
        op=operator,
    )
    assert st["phase"] == "ClusterProvisioning"
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["RayClusterReady"]["reason"] == "Unschedulable"
    st = ks.wait_phase(k8s_plane, ns, "toobig", {"Failed"}, timeout=120, op=operator)
    assert "clusterReadySeconds" in st["message"] and "Insufficient nvidia.com/gpu" in st["message"]
    assert {c["type"]: c for c in st["conditions"]}["RayClusterReady"]["reason"] == "ClusterTimeout"
    delete_and_wait(k8s_plane, ns, "toobig", operator, timeout=60)
    ks.wait_for(
        lambda: (
            k8s_plane.kubectl("get", "raycluster", "toobig", "-n", ns, check=False).returncode != 0
        ),
        timeout=60,
        what="the RayCluster to go",
    )


def test_a_readwriteonce_claim_that_two_pods_mount_is_refused_before_any_pod(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    """The operator's least-privilege account reads the claim (its ``get`` on claims: a 403
    would leave the claim unjudged and the group would go on) and fails the group: the worker
    pod and the Tinker server (on by default) would both mount a ReadWriteOnce claim."""
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "rwo-ckpt", "namespace": ns},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "none-here",  # stays Pending: its requested mode is judged
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    k8s_plane.apply(claim)
    body = ks.noop("rwoclaim", ns)
    body["spec"]["rayCluster"]["storage"] = {"claimName": "rwo-ckpt", "mountPath": "/ckpt"}
    body["spec"].setdefault("training", {})["checkpointDir"] = "/ckpt/rwoclaim"
    k8s_plane.apply(body)
    st = ks.wait_phase(k8s_plane, ns, "rwoclaim", {"Failed"}, timeout=120, op=operator)
    cond = {c["type"]: c for c in st["conditions"]}["RayClusterReady"]
    assert (cond["status"], cond["reason"]) == ("False", "ClaimAccessMode"), cond
    assert "checkpoint claim rwo-ckpt is ReadWriteOnce" in st["message"], st["message"]
    assert "the Tinker server (spec.api.tinker)" in st["message"], st["message"]
    assert (
        k8s_plane.kubectl("get", "raycluster", "rwoclaim", "-n", ns, check=False).returncode != 0
    )
    delete_and_wait(k8s_plane, ns, "rwoclaim", operator, timeout=60)
    k8s_plane.kubectl("delete", "pvc", "rwo-ckpt", "-n", ns, "--wait=false", check=False)


# -- the whole life of a group -------------------------------------------------------------
def test_lifecycle_train_delete(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess, ray_endpoint: RayEndpoint, tmp_path: Path
) -> None:
    name = "tiny"
    t0 = time.monotonic()
    offset = operator.log_path.stat().st_size if operator.log_path.exists() else 0
    k8s_plane.apply(ks.trainergroup(name, ns))

    # RayCluster with GPU requests/limits and the GPU toleration, owned by the TrainerGroup
    rc = ks.wait_for(
        lambda: (
            k8s_plane.kubectl_json("get", "raycluster", name, "-n", ns)
            if k8s_plane.kubectl("get", "raycluster", name, "-n", ns, check=False).returncode == 0
            else None
        ),
        timeout=120,
        what="the RayCluster",
        detail=operator.tail,
    )
    head = rc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    worker_pod = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    res = worker_pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "2" and res["requests"]["nvidia.com/gpu"] == "2"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker_pod[
        "tolerations"
    ]
    tg_uid = ks.get_tg(k8s_plane, ns, name)["metadata"]["uid"]  # type: ignore[index]
    assert rc["metadata"]["ownerReferences"][0]["uid"] == tg_uid
    # token auth and the NetworkPolicy, made with the operator's own RBAC (create only)
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == f"{name}-ray-token"
    secret = k8s_plane.kubectl_json("get", "secret", f"{name}-ray-token", "-n", ns)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == tg_uid
    assert secret["data"]["auth_token"]
    policy = k8s_plane.kubectl_json("get", "networkpolicy", f"{name}-ray", "-n", ns)
    assert policy["spec"]["podSelector"] == {"matchLabels": {"ray.io/cluster": name}}

    # pods scheduled on the fake GPU node
    def worker_pod_node() -> str | None:
        pods = k8s_plane.kubectl_json(
            "get", "pods", "-n", ns, "-l", f"ray.io/cluster={name},ray.io/node-type=worker"
        )
        nodes = [p["spec"].get("nodeName") for p in pods["items"]]
        return nodes[0] if nodes and nodes[0] else None

    assert ks.wait_for(worker_pod_node, timeout=120, what="a scheduled worker pod") == "kwok-gpu-0"

    st = ks.wait_phase(k8s_plane, ns, name, {"Ready", "Failed"}, timeout=READY_TIMEOUT, op=operator)
    assert st["phase"] == "Ready", ks.dump(st)
    print(f"apply -> Ready: {time.monotonic() - t0:.1f}s")
    # a normal apply is quiet: Normal events only, no ERROR or WARNING in the operator's log
    # from the apply to Ready (test_apply_to_ready_posts_no_warning_and_logs_no_error's checks,
    # on a noop group of its own until 2026-12-06)
    # (the Ready event is posted after the status that says Ready: wait for it, CI 15:27)
    def normal_reasons() -> set[str]:
        events = ks.events_of(k8s_plane, ns, name)
        warned = [(e["reason"], e.get("message")) for e in events if e.get("type") == "Warning"]
        assert warned == [], ks.dump(events)
        return {e["reason"] for e in events if e.get("type") == "Normal"}

    want = {"RayClusterCreated", "ServerSubmitted", "Ready"}
    ks.wait_for(lambda: want <= normal_reasons(), timeout=30,
                what=f"the Normal events {sorted(want)}",
                detail=lambda: ks.dump(ks.events_of(k8s_plane, ns, name)))
    with operator.log_path.open("rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    bad = [ln for ln in lines if "[ERROR" in ln or "[WARNING" in ln or "Traceback" in ln]
    assert bad == [], "\n".join(bad[:20])
    assert len(st["workerNames"]) == 2 and st["worldSize"] == 2 and st["readyWorkers"] == 2
    assert st["rayAddress"] == ray_endpoint.gcs_address
    assert st["rayNamespace"] == f"tg-{ns}-{name}" and st["groupName"] == name
    assert st["mesh"] == {"tp": 2, "pp": 1, "cp": 1, "dp": 1}
    assert [w["rank"] for w in st["workers"]] == [0, 1]
    assert all(w["state"] == "ALIVE" and w["pid"] > 0 for w in st["workers"])
    cond = {c["type"]: c["status"] for c in st["conditions"]}
    assert cond == {
        "RayClusterReady": "True",
        "WorkersReady": "True",
        "Degraded": "False",
        "Training": "Unknown",  # no step yet
    }
    alive = {
        a.name
        for a in ks.actors(ray_endpoint.dashboard_url, st["rayNamespace"])
        if a.state == "ALIVE"
    }
    assert set(st["workerNames"]) <= alive

    # a client started with only the TrainerGroup's name attaches and trains
    client_kubeconfig = ks.grant(
        k8s_plane, namespace=ns, account="tg-client", rules=rbac.CLIENT_RULES, cluster_wide=False
    )
    proc = client_wait(name, ns, client_kubeconfig, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {
        "rayAddress": st["rayAddress"],
        "rayNamespace": st["rayNamespace"],
        "groupName": name,
        "workerNames": st["workerNames"],
    }
    steps = run_client(name, ns, client_kubeconfig, tmp_path)
    assert len(steps) == 3, steps
    assert steps[-1]["loss"] < steps[0]["loss"], steps

    # rank 0's progress reaches the status on a health tick (the operator reads rank 0's
    # progress file through the dashboard's log API): step, loss, the Training condition
    st_trained = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: (s.get("training") or {}).get("step") == 3,
        timeout=60,
        what="status.training",
        op=operator,
    )
    assert st_trained["training"]["loss"] == pytest.approx(steps[-1]["loss"], rel=1e-5)
    assert st_trained["training"]["tokensPerSecond"] > 0 and st_trained["training"]["lastStepTime"]
    training_cond = {c["type"]: c for c in st_trained["conditions"]}["Training"]
    assert (training_cond["status"], training_cond["reason"]) == ("True", "StepsArriving")
    # a settled, trained group writes no status on its health ticks (measured: writes/tick).
    # The API server shows the step-3 status before the operator's patch call returns and
    # counts it; wait for the operator's own series (set after the count) before sampling.
    labels = f'name="{name}",namespace="{ns}"'  # the exposition sorts label names
    ks.wait_for(
        lambda: f"trainergroup_training_step{{{labels}}} 3.0" in operator.metrics(),
        timeout=30,
        what="the operator to count its step-3 status write",
    )
    writes_before = _sample(operator.metrics(), "tg_operator_status_writes_total")
    time.sleep(5 * HEALTH_INTERVAL_S)
    writes_after = _sample(operator.metrics(), "tg_operator_status_writes_total")
    print(f"status writes over 5 idle health ticks: {writes_after - writes_before:g}")
    assert writes_after == writes_before
    series = operator.metrics()
    assert f"trainergroup_training_step{{{labels}}} 3.0" in series, series
    assert f'trainergroup_phase{{{labels},phase="Ready"}} 1.0' in series

    # delete: Ray cleaned first, then the finalizer goes, then the RayCluster
    ray_ns = st["rayNamespace"]
    delete_and_wait(k8s_plane, ns, name, operator)
    assert not [a for a in ks.actors(ray_endpoint.dashboard_url, ray_ns) if a.state != "DEAD"]
    assert ks.live_placement_groups(ray_endpoint.dashboard_url, ray_ns) == []
    ks.wait_for(
        lambda: k8s_plane.kubectl("get", "raycluster", name, "-n", ns, check=False).returncode != 0,
        timeout=120,
        what="the RayCluster to go",
    )
    assert "CleanedUp" in [e["reason"] for e in ks.events_of(k8s_plane, ns, name)]


def _sample(text: str, metric: str) -> float:
    """The value of an unlabelled sample in a /metrics text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(f"{metric} "):
            return float(line.split()[1])
    return 0.0


def client_wait(
    name: str, ns: str, kubeconfig: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``tgruntime.entrypoints.client_job wait --print-address`` (the client Job's first step)."""
    argv = ["--trainergroup", name, "--k8s-namespace", ns, "--kubeconfig", str(kubeconfig)]
    return subprocess.run(
        [sys.executable, "-m", "tgruntime.entrypoints.client_job", "wait", *argv,
         "--print-address", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ks.REPO)},
        check=False,
    )


def run_client(name: str, ns: str, kubeconfig: Path, tmp_path: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ks.REPO)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tgruntime.entrypoints.client_job",
            "--trainergroup",
            name,
            "--k8s-namespace",
            ns,
            "--kubeconfig",
            str(kubeconfig),
            "--steps",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return [
        json.loads(line.split(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("TG_STEP ")
    ]


# -- restarts of the operator, spec changes ------------------------------------------------
def test_operator_killed_mid_reconcile_does_not_duplicate(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess, ray_endpoint: RayEndpoint
) -> None:
    name = "resumed"
    k8s_plane.apply(ks.noop(name, ns))

    st = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: s.get("submissionId") and s.get("phase") == "WorkersStarting",
        timeout=300,
        what="the server job to be submitted",
        op=operator,
    )
    operator.stop(kill=True)  # SIGKILL in the middle of waiting for the server job
    time.sleep(2)
    operator.start()
    st = ks.wait_phase(k8s_plane, ns, name, {"Ready", "Failed"}, timeout=READY_TIMEOUT, op=operator)
    assert st["phase"] == "Ready", ks.dump(st)
    assert st["groupGeneration"] == 0 and st.get("restarts", 0) == 0
    uid8 = ks.get_tg(k8s_plane, ns, name)["metadata"]["uid"].replace("-", "")[:8]  # type: ignore[index]
    jobs = ks.ray_jobs(ray_endpoint.dashboard_url, f"tg-{ns}-{name}-{uid8}-g")
    assert [j["submission_id"] for j in jobs] == [st["submissionId"]]
    clusters = k8s_plane.kubectl_json(
        "get", "rayclusters", "-n", ns, "-l", f"trainergroup.io/name={name}"
    )["items"]
    assert len(clusters) == 1
    live = [
        a for a in ks.actors(ray_endpoint.dashboard_url, st["rayNamespace"]) if a.state == "ALIVE"
    ]
    assert sorted(a.name for a in live) == sorted(st["workerNames"])

    # a spec change the workers depend on re-creates the group (new generation)
    k8s_plane.kubectl(
        "patch",
        "trainergroup",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"optimizer": {"lr": 0.002}}}),
    )

    st2 = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: s.get("groupGeneration") == 1 and s.get("phase") == "Ready",
        timeout=READY_TIMEOUT,
        what="the group re-created",
        op=operator,
    )
    assert st2["restarts"] == 0 and st2["observedGeneration"] == 2
    live = [
        a for a in ks.actors(ray_endpoint.dashboard_url, st2["rayNamespace"]) if a.state == "ALIVE"
    ]
    assert sorted(a.name for a in live) == sorted(st2["workerNames"])

    # kill one worker: Degraded (rank and cause), then Ready under a new generation. (A noop
    # group's worker: what the operator sees of a dead actor is the same as of a trainer's, and
    # the kind suite's chaos fault worker-killed-mid-step kills a training rank in a pod.)
    victim = st2["workers"][1]
    os.kill(int(victim["pid"]), signal.SIGKILL)

    deg = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: s.get("phase") == "Degraded",
        timeout=120,
        what="Degraded",
        op=operator,
    )
    assert "rank 1" in deg["message"], deg["message"]
    st3 = ks.wait_phase(
        k8s_plane, ns, name, {"Ready", "Failed"}, timeout=READY_TIMEOUT, op=operator
    )
    assert st3["phase"] == "Ready", ks.dump(st3)
    assert st3["groupGeneration"] == st2["groupGeneration"] + 1
    assert st3["restarts"] == st2.get("restarts", 0) + 1
    assert st3["workerNames"] != st2["workerNames"]  # new names are published
    assert st3["submissionId"] != st2["submissionId"]
    reasons = [e["reason"] for e in ks.events_of(k8s_plane, ns, name)]
    assert "Restarting" in reasons and "Degraded" in reasons

    # labels are not a reason to re-create the group
    k8s_plane.kubectl("label", "trainergroup", name, "-n", ns, "team=ml")

    def label_handled(obj: dict[str, Any]) -> bool:
        # kopf records the configuration it last handled (labels included) in this annotation:
        # once it holds the label, the operator has processed the change
        notes = obj.get("metadata", {}).get("annotations") or {}
        raw = notes.get("kopf.trainergroup.io/last-handled-configuration") or "{}"
        return bool(json.loads(raw).get("metadata", {}).get("labels", {}).get("team") == "ml")

    ks.wait_object(
        k8s_plane,
        ns,
        name,
        label_handled,
        timeout=60,
        what="the operator to handle the label change",
        op=operator,
    )
    st4 = ks.status_of(k8s_plane, ns, name)
    assert (st4["phase"], st4["groupGeneration"]) == ("Ready", st3["groupGeneration"])

    # the counter is this operator process's, started after the SIGKILL above: this test's
    # worker restart is its only one, whatever ran before in the module
    metrics = operator.metrics()
    assert "tg_operator_worker_restarts_total 1.0" in metrics
    assert 'tg_operator_trainergroups{phase="Ready"}' in metrics

    delete_and_wait(k8s_plane, ns, name, operator)
    assert ks.live_placement_groups(ray_endpoint.dashboard_url, st3["rayNamespace"]) == []


# -- deletion when Ray cannot be reached ---------------------------------------------------
def test_deletion_retries_while_ray_is_unreachable_and_can_be_forced(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    name = "orphan"
    body = ks.noop(name, ns, rayCluster=None, rayClusterRef={"name": "nowhere"})
    body["spec"]["timeouts"]["clusterReadySeconds"] = 3
    k8s_plane.apply(body)
    st = ks.wait_phase(k8s_plane, ns, name, {"Failed"}, timeout=120, op=operator)
    assert "the referenced RayCluster nowhere does not exist" in st["message"]
    # pretend a group had been started on a Ray that is now gone
    dead_url = f"http://127.0.0.1:{ks.free_port()}"
    k8s_plane.kubectl(
        "patch",
        "trainergroup",
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "status": {
                    "submissionId": "tg-gone-g0",
                    "dashboardURL": dead_url,
                    "workerNames": ["orphanNoopWorker_0:0"],
                }
            }
        ),
    )
    k8s_plane.kubectl("delete", "trainergroup", name, "-n", ns, "--wait=false")

    st = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: "cannot reach Ray" in s.get("message", ""),
        timeout=60,
        what="the reason in the status",
        op=operator,
    )
    assert st["phase"] == "Terminating"
    assert "trainergroup.io/force-delete" in st["message"]
    assert "trainergroup.io/finalizer" in ks.get_tg(k8s_plane, ns, name)["metadata"]["finalizers"]  # type: ignore[index]
    assert "CleanupRetrying" in {e["reason"] for e in ks.events_of(k8s_plane, ns, name)}
    k8s_plane.kubectl(
        "annotate", "trainergroup", name, "-n", ns, "trainergroup.io/force-delete=true"
    )
    ks.wait_gone(k8s_plane, ns, name, timeout=90, op=operator)


# -- a crash-looping group: restarts back off, then RestartLimit ---------------------------
# (tests/operator/test_k8s_backoff.py until 2026-12-06: one operator process, namespace and
# account fewer.) The workers (``hack.noop_worker:CrashingWorker``) exit a few seconds after
# they start, so every group generation dies. The assertions are on what the operator records
# (status.restarts, lastRestartTime, nextRestartTime, the Restarting events, the final phase),
# not on how long anything took; every status version is seen (a watch, not polling).
MAX_RESTARTS = 2


def _time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def test_a_crash_looping_group_backs_off_and_ends_restart_limit(
    k8s_plane: Any, ns: str, operator: ks.OperatorProcess
) -> None:
    name = "crashloop"
    body = ks.noop(name, ns, maxRestarts=MAX_RESTARTS)
    body["spec"]["workers"]["workerClass"] = "hack.noop_worker:CrashingWorker"
    k8s_plane.apply(body)
    seen: list[dict[str, Any]] = []

    def record(st: dict[str, Any]) -> None:
        if st and (not seen or seen[-1] != st):
            seen.append(st)

    final = ks.wait_status(
        k8s_plane,
        ns,
        name,
        lambda s: s.get("phase") == "Failed",
        timeout=600,
        what="Failed",
        op=operator,
        on_change=record,
    )
    assert final == seen[-1]
    assert final["restarts"] == MAX_RESTARTS, ks.dump(final)
    reasons = {c["type"]: c["reason"] for c in final["conditions"]}
    assert reasons["WorkersReady"] == "RestartLimit", final["conditions"]
    assert f"spec.maxRestarts ({MAX_RESTARTS}) is reached" in final["message"]
    assert final["groupGeneration"] == MAX_RESTARTS
    # restarts only go up, one at a time
    counts = [s.get("restarts", 0) for s in seen]
    assert counts == sorted(counts) and set(counts) == set(range(MAX_RESTARTS + 1)), counts
    # the second re-creation waited for its back-off: nextRestartTime was set BACKOFF_S or
    # more after the first re-creation (it counts from when the death was seen)
    waits = [
        (_time(s["nextRestartTime"]) - _time(s["lastRestartTime"])).total_seconds()
        for s in seen
        if s.get("nextRestartTime") and s.get("lastRestartTime") and s.get("restarts") == 1
    ]
    assert waits and min(waits) >= BACKOFF_S, [s.get("nextRestartTime") for s in seen]
    events = ks.events_of(k8s_plane, ns, name)
    restarting = [e["message"] for e in events if e["reason"] == "Restarting"]
    assert len(restarting) == MAX_RESTARTS, restarting
    assert any(f"in {BACKOFF_S}s (restart 2 of at most" in m for m in restarting), restarting
    assert any("now (restart 1 of at most" in m for m in restarting), restarting
    delete_and_wait(k8s_plane, ns, name, operator)
