"""The chart and manifests/ against a real API server (hack/plane.py: RBAC on, PodSecurity
admission, kwok nodes, KubeRay's CRDs): server-side validation, `helm install/upgrade/
uninstall`, and least-privilege RBAC checked with the ServiceAccounts' real tokens.

kwok fakes pods, so the operator's Deployment becomes Available without the operator
process running; tests that run the real operator with the chart's token reuse
`tests.deploy.chart.install_chart`.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import tgapi.kube_view
from tests.deploy.chart import (
    CHART,
    CRD_DISCOVERY,
    CRD_FILE,
    EXAMPLE_JOB,
    EXAMPLE_TG,
    FINALIZER,
    MANIFESTS,
    OPERATOR_DENIED,
    OPERATOR_DENIED_CLUSTER,
    OPERATOR_NEEDS,
    ChartRelease,
    access,
    client_job_wait_command,
    install_chart,
    template,
    whoami,
)
from tests.fixtures_k8s import KubePlane, wait_until

pytestmark = pytest.mark.k8s

TG_NEEDS_CLUSTER_WIDE = [
    ("list", "trainergroups.trainergroup.io"),
    ("watch", "trainergroups.trainergroup.io"),
]


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd(k8s_plane: KubePlane) -> str:
    """The TrainerGroup CRD, installed from the chart's crds/ and Established."""
    k8s_plane.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=tg-deploy-tests",
        "-f",
        str(CRD_FILE),
    )
    name: str = yaml.safe_load(CRD_FILE.read_text())["metadata"]["name"]
    k8s_plane.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return name


@pytest.fixture(scope="module")
def new_namespace(k8s_plane: KubePlane) -> Iterator[Callable[[str], str]]:
    """Make namespaces for this module; all deleted (without waiting) at its end."""
    made: list[str] = []

    def make(prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        k8s_plane.kubectl("create", "namespace", name)
        made.append(name)
        return name

    yield make
    for name in made:
        k8s_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def watched(new_namespace: Callable[[str], str]) -> tuple[str, str]:
    """Two namespaces with TrainerGroups in them."""
    return new_namespace("team-a"), new_namespace("team-b")


@pytest.fixture(scope="module")
def release(
    k8s_plane: KubePlane, crd: str, new_namespace: Callable[[str], str], watched: tuple[str, str]
) -> Iterator[ChartRelease]:
    """The chart with its defaults (all namespaces), plus a client allowed to read 'mine'."""
    ns = new_namespace("tg-system")
    rel = install_chart(
        k8s_plane,
        "tgd",
        ns,
        {"clients": [{"name": "tg-client", "namespace": watched[0], "trainerGroups": ["mine"]}]},
        wait=True,
    )
    yield rel
    rel.uninstall(wait=False)


def trainergroup(name: str, namespace: str, **labels: str) -> dict[str, Any]:
    """The example TrainerGroup under another name/namespace."""
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE_TG.read_text())
    doc["metadata"] = {"name": name, "namespace": namespace, "labels": labels}
    return doc


def kubectl_as(
    plane: KubePlane, kubeconfig: Path, *args: str, input: str | None = None
) -> tuple[bool, str]:
    """(succeeded, output) of a kubectl call with another identity's kubeconfig."""
    proc = plane.kubectl(*args, kubeconfig=kubeconfig, check=False, input=input)
    return proc.returncode == 0, proc.stdout + proc.stderr


def exists(plane: KubePlane, kind: str, name: str, namespace: str | None = None) -> bool:
    ns = ["-n", namespace] if namespace else []
    return plane.kubectl("get", kind, name, *ns, check=False).returncode == 0


# ---- server-side validation ------------------------------------------------------------------


def test_rendered_chart_passes_server_side_validation(
    k8s_plane: KubePlane, crd: str, helm: str, new_namespace: Callable[[str], str]
) -> None:
    """`kubectl apply --dry-run=server --validate=strict` (the API server's own schemas,
    unknown fields rejected, admission run) accepts everything the chart renders."""
    ops, team = new_namespace("dry-ops"), new_namespace("dry-team")
    variants: dict[str, dict[str, Any]] = {
        "all namespaces": {},
        "namespaced": {"watchNamespaces": [team], "rbac": {"create": True, "crdDiscovery": True}},
        "clients and options": {
            "clients": [{"name": "c1", "namespace": team, "trainerGroups": ["x"]}],
            "extraEnv": [{"name": "A", "value": "1"}],
            "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "metrics": {
                "port": 9191,
                "service": {"enabled": True, "type": "NodePort"},
                "serviceMonitor": {"enabled": False},
            },
        },
    }
    for what, values in variants.items():
        docs = template(helm, values, release="dry", namespace=ops)
        assert isinstance(docs, list)
        proc = k8s_plane.kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            "--validate=strict",
            "--field-manager=tg-deploy-tests",
            "-f",
            "-",
            input=yaml.safe_dump_all(docs),
            check=False,
        )
        assert proc.returncode == 0, f"{what}: {proc.stderr}"
        assert proc.stdout.count("(server dry run)") == len(docs), proc.stdout


def test_example_trainergroup_passes_the_crd_on_the_server(
    k8s_plane: KubePlane, crd: str, new_namespace: Callable[[str], str]
) -> None:
    """The real API server (OpenAPI schema + CEL rules of the CRD) accepts the example and
    rejects what tgapi rejects, with the same message."""
    ns = new_namespace("tg-example")
    good = trainergroup("llama-tp2", ns)

    def dry_run(doc: dict[str, Any]) -> tuple[bool, str]:
        proc = k8s_plane.kubectl(
            "create",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            "-",
            input=yaml.safe_dump(doc),
            check=False,
        )
        return proc.returncode == 0, proc.stdout + proc.stderr

    ok, out = dry_run(good)
    assert ok, out
    # the file itself, as shipped (namespace default)
    proc = k8s_plane.kubectl(
        "create", "--dry-run=server", "--validate=strict", "-f", str(EXAMPLE_TG), check=False
    )
    assert proc.returncode == 0, proc.stderr

    bad = copy.deepcopy(good)
    bad["spec"]["parallelism"]["tensor"] = 3  # 2 workers: TP 3 does not divide
    ok, out = dry_run(bad)
    assert not ok and "does not divide the world size" in out, out
    bad = copy.deepcopy(good)
    bad["spec"]["model"]["dtype"] = "fp8"
    ok, out = dry_run(bad)
    assert not ok and "spec.model.dtype" in out, out
    bad = copy.deepcopy(good)
    bad["spec"]["model"]["hiddenSizee"] = 1  # a typo is an error, not silently pruned
    ok, out = dry_run(bad)
    assert not ok and "hiddenSizee" in out, out


def test_manifests_apply_and_the_operator_pod_meets_restricted_pod_security(
    k8s_plane: KubePlane, crd: str
) -> None:
    """`kubectl apply -f manifests/...` as docs/deploy.md says: the objects are created, the
    namespace enforces the 'restricted' Pod Security Standard and the operator's pod is
    admitted under it (a non-compliant pod is refused there, so the check has teeth)."""
    files = [
        MANIFESTS / "namespace.yaml",
        *sorted((MANIFESTS / "operator").glob("*.yaml")),
        MANIFESTS / "rbac" / "cluster-scoped.yaml",
    ]
    args = [a for f in files for a in ("-f", str(f))]
    k8s_plane.kubectl("apply", "--server-side", "--field-manager=tg-deploy-tests", *args)
    try:
        ns = yaml.safe_load((MANIFESTS / "namespace.yaml").read_text())["metadata"]["name"]
        deploy = yaml.safe_load((MANIFESTS / "operator" / "deployment.yaml").read_text())
        name = deploy["metadata"]["name"]
        proc = k8s_plane.kubectl(
            "rollout",
            "status",
            f"deployment/{name}",
            "-n",
            ns,
            "--timeout=120s",
            check=False,
            timeout=150,
        )
        assert proc.returncode == 0, (
            proc.stdout,
            proc.stderr,
            k8s_plane.kubectl("get", "events", "-n", ns, check=False).stdout,
        )
        pods = k8s_plane.kubectl_json("get", "pods", "-n", ns)["items"]
        assert len(pods) == 1 and pods[0]["status"]["phase"] == "Running"

        rogue = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "rogue", "namespace": ns},
            # the defaults: root allowed, privilege escalation, all capabilities
            "spec": {"containers": [{"name": "c", "image": "busybox:1.36"}]},
        }
        proc = k8s_plane.kubectl(
            "create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(rogue), check=False
        )
        assert proc.returncode != 0 and 'violates PodSecurity "restricted' in proc.stderr, (
            proc.stderr
        )

        # the client's RBAC, the example and its Job, as the docs apply them
        for f in (MANIFESTS / "client" / "rbac.yaml", EXAMPLE_TG, EXAMPLE_JOB):
            proc = k8s_plane.kubectl(
                "apply",
                "--server-side",
                "--dry-run=server",
                "--validate=strict",
                "-f",
                str(f),
                check=False,
            )
            assert proc.returncode == 0, f"{f}: {proc.stderr}"
    finally:
        k8s_plane.kubectl("delete", "--ignore-not-found", "--wait=false", *args, check=False)


# ---- helm install: what exists, and the operator's RBAC ----------------------------------------


def test_helm_install_creates_the_operator(
    k8s_plane: KubePlane, release: ChartRelease, crd: str, watched: tuple[str, str]
) -> None:
    ns = release.namespace
    status = json.loads(k8s_plane.helm("status", release.release, "-n", ns, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    notes = status["info"]["notes"]
    assert "kubectl apply -f manifests/examples/trainergroup.yaml" in notes
    assert "kubectl get tg llama-tp2 -o jsonpath='{.status.phase}" in notes
    assert "kubectl apply --server-side -f charts/trainergroup/crds/" in notes
    assert f"{watched[0]}/tg-client: may read TrainerGroups mine" in notes

    deploy = k8s_plane.kubectl_json("get", "deployment", release.deployment, "-n", ns)
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "Recreate"
    assert deploy["status"].get("availableReplicas") == 1  # kwok runs a fake pod
    pod_spec = deploy["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == release.operator_service_account
    assert exists(k8s_plane, "serviceaccount", release.operator_service_account, ns)
    assert exists(k8s_plane, "clusterrole", f"{release.fullname}-operator")
    assert exists(k8s_plane, "clusterrolebinding", f"{release.fullname}-operator")
    assert exists(k8s_plane, "service", f"{release.fullname}-operator-metrics", ns)
    assert not k8s_plane.kubectl_json(
        "get", "roles", "-n", watched[0], "-l", "app.kubernetes.io/component=operator"
    )["items"]
    for kind in ("serviceaccount", "role", "rolebinding"):
        assert exists(k8s_plane, kind, "tg-client", watched[0])
    assert exists(k8s_plane, "crd", crd)
    assert release.operator_env()["TG_NAMESPACES"] == ""


def test_operator_token_authenticates_as_the_chart_service_account(
    release: ChartRelease,
) -> None:
    assert whoami(release.kubeconfig) == release.subject


def test_operator_rbac_is_enough(release: ChartRelease, watched: tuple[str, str]) -> None:
    """Every verb tg_operator.rbac declares is allowed, in every namespace (ClusterRole)."""
    for ns in watched:
        answers = access(release.kubeconfig, OPERATOR_NEEDS, namespace=ns)
        assert all(answers.values()), {k: v for k, v in answers.items() if not v}
    answers = access(release.kubeconfig, TG_NEEDS_CLUSTER_WIDE, namespace=None)
    assert all(answers.values()), answers


def test_operator_rbac_is_not_more(release: ChartRelease, watched: tuple[str, str]) -> None:
    answers = access(release.kubeconfig, OPERATOR_DENIED, namespace=watched[0])
    assert not any(answers.values()), {k: v for k, v in answers.items() if v}
    answers = access(release.kubeconfig, OPERATOR_DENIED_CLUSTER + CRD_DISCOVERY, namespace=None)
    assert not any(answers.values()), {k: v for k, v in answers.items() if v}


def test_operator_token_real_requests(
    k8s_plane: KubePlane, release: ChartRelease, watched: tuple[str, str]
) -> None:
    """The calls the operator makes, made with its token: allowed; a few it never makes:
    Forbidden."""
    ns = watched[0]
    kc = release.kubeconfig
    k8s_plane.apply(trainergroup("op-probe", ns))
    try:
        ok, out = kubectl_as(k8s_plane, kc, "get", "trainergroups.trainergroup.io", "-A")
        assert ok and "op-probe" in out, out
        ok, out = kubectl_as(
            k8s_plane,
            kc,
            "patch",
            "trainergroup",
            "op-probe",
            "-n",
            ns,
            "--type=merge",
            "-p",
            json.dumps(
                {
                    "metadata": {
                        "finalizers": [FINALIZER],
                        "annotations": {"kopf.trainergroup.io/probe": "1"},
                    }
                }
            ),
        )
        assert ok, out
        ok, out = kubectl_as(
            k8s_plane,
            kc,
            "patch",
            "trainergroup",
            "op-probe",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status": {"phase": "Pending"}}',
        )
        assert ok, out
        phase = k8s_plane.kubectl(
            "get", "tg", "op-probe", "-n", ns, "-o", "jsonpath={.status.phase}"
        ).stdout
        assert phase == "Pending"
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"op-probe.{uuid.uuid4().hex[:8]}", "namespace": ns},
            "involvedObject": {
                "apiVersion": "trainergroup.io/v1alpha1",
                "kind": "TrainerGroup",
                "name": "op-probe",
                "namespace": ns,
            },
            "reason": "Probe",
            "message": "RBAC probe",
            "type": "Normal",
        }
        ok, out = kubectl_as(
            k8s_plane, kc, "create", "--validate=false", "-f", "-", input=yaml.safe_dump(event)
        )
        assert ok, out
        raycluster = {
            "apiVersion": "ray.io/v1",
            "kind": "RayCluster",
            "metadata": {"name": "op-probe", "namespace": ns},
            "spec": {
                "headGroupSpec": {
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]
                        }
                    },
                }
            },
        }
        ok, out = kubectl_as(
            k8s_plane,
            kc,
            "create",
            "--dry-run=server",
            "--validate=false",
            "-f",
            "-",
            input=yaml.safe_dump(raycluster),
        )
        assert ok, out
        ok, out = kubectl_as(k8s_plane, kc, "get", "raycluster", "op-probe", "-n", ns)
        assert not ok and "NotFound" in out, out  # allowed to look; nothing there
        ok, out = kubectl_as(k8s_plane, kc, "get", "pods", "-n", ns)
        assert ok, out
        # the operator's watches (kopf indexes) list RayClusters
        ok, out = kubectl_as(k8s_plane, kc, "get", "rayclusters", "-n", ns)
        assert ok, out

        for denied in (
            ("get", "secrets", "-n", ns),
            ("get", "configmaps", "-n", ns),
            ("delete", "trainergroup", "op-probe", "-n", ns),
            ("get", "nodes"),
        ):
            ok, out = kubectl_as(k8s_plane, kc, *denied)
            assert not ok and "Forbidden" in out, (denied, out)
    finally:
        k8s_plane.kubectl(
            "patch",
            "tg",
            "op-probe",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"metadata": {"finalizers": null}}',
            check=False,
        )
        k8s_plane.kubectl("delete", "tg", "op-probe", "-n", ns, "--ignore-not-found", check=False)


def test_client_reads_its_trainergroup_and_nothing_else(
    k8s_plane: KubePlane, release: ChartRelease, watched: tuple[str, str]
) -> None:
    """The client ServiceAccount (values `clients`), with its real token: reads 'mine' (also
    through the client's own status reader), is denied 'other', listing, writing, Secrets."""
    ns = watched[0]
    mine, other = trainergroup("mine", ns), trainergroup("other", ns)
    k8s_plane.apply([mine, other])
    k8s_plane.kubectl(
        "patch",
        "tg",
        "mine",
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(
            {
                "status": {
                    "phase": "Ready",
                    "observedGeneration": 1,
                    "rayNamespace": "r-ns",
                    "rayAddress": "mine-head-svc:6379",
                    "workerNames": ["w0", "w1"],
                }
            }
        ),
    )
    kc = release.client_kubeconfig("tg-client", ns)
    assert whoami(kc) == f"system:serviceaccount:{ns}:tg-client"
    try:
        ok, out = kubectl_as(
            k8s_plane, kc, "get", "tg", "mine", "-n", ns, "-o", "jsonpath={.status.phase}"
        )
        assert ok and out == "Ready", out
        for denied in (
            ("get", "tg", "other", "-n", ns),
            ("get", "tg", "-n", ns),
            ("get", "tg", "-A"),
            ("patch", "tg", "mine", "-n", ns, "--type=merge", "-p", '{"spec": {}}'),
            ("delete", "tg", "mine", "-n", ns),
            ("get", "secrets", "-n", ns),
            ("get", "secret", "other-tinker-keys", "-n", ns),
            ("get", "tg", "mine", "-n", watched[1]),
        ):
            ok, out = kubectl_as(k8s_plane, kc, *denied)
            assert not ok and "Forbidden" in out, (denied, out)
        # its group's Tinker keys and Ray token: allowed to read (none exists here: NotFound)
        for secret in ("mine-tinker-keys", "mine-ray-token"):
            ok, out = kubectl_as(k8s_plane, kc, "get", "secret", secret, "-n", ns)
            assert not ok and "NotFound" in out, (secret, out)

        # watch, restricted to the one name by a field selector (kubectl get tg mine -w)
        answers = access(
            kc,
            [("get", "trainergroups.trainergroup.io"), ("watch", "trainergroups.trainergroup.io")],
            namespace=ns,
            name="mine",
        )
        assert all(answers.values()), answers
        answers = access(
            kc,
            [
                ("get", "trainergroups.trainergroup.io"),
                ("watch", "trainergroups.trainergroup.io"),
                ("list", "trainergroups.trainergroup.io"),
            ],
            namespace=ns,
            name="other",
        )
        assert not any(answers.values()), answers

        # the client's real code path (tg-client --trainergroup uses this reader)
        status = tgapi.kube_view.read_status(name="mine", k8s_namespace=ns, kubeconfig=str(kc))
        assert status.phase == "Ready" and status.ray_namespace == "r-ns"
        with pytest.raises(tgapi.kube_view.TrainerGroupForbidden, match="get and watch"):
            tgapi.kube_view.read_status(name="other", k8s_namespace=ns, kubeconfig=str(kc))

        # the example client Job's first step (wait for Ready, print rayAddress), as the pod
        # would run it, with the client's token
        def job_wait(name: str) -> subprocess.Popen[str]:
            env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
            env.update(KUBECONFIG=str(kc), TG_NAME=name, POD_NAMESPACE=ns, TG_PYTHON=sys.executable)
            command = client_job_wait_command().replace("python ", '"$TG_PYTHON" ', 1)
            return subprocess.Popen(
                ["bash", "-ceu", command + " --timeout 60"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        def finished(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
            out, err = proc.communicate(timeout=90)
            return proc.returncode, out, err

        code, out, err = finished(job_wait("mine"))
        assert (code, out) == (0, "mine-head-svc:6379\n"), err
        code, _, err = finished(job_wait("other"))
        assert code == 1 and "Forbidden" in err and "get and watch" in err, err

        # the wait is a watch: started while 'mine' is Pending, it returns when 'mine' turns
        # Ready (a status it first sees after it has printed the Pending one)
        def set_phase(phase: str) -> None:
            k8s_plane.kubectl(
                "patch",
                "tg",
                "mine",
                "-n",
                ns,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": {"phase": phase, "message": phase.lower()}}),
            )

        set_phase("Pending")
        waiting = job_wait("mine")
        assert waiting.stderr is not None
        assert "Pending" in waiting.stderr.readline()  # it has read the object: now watching
        set_phase("Ready")
        code, out, _ = finished(waiting)
        assert (code, out) == (0, "mine-head-svc:6379\n")
        k8s_plane.kubectl(
            "patch",
            "tg",
            "mine",
            "-n",
            ns,
            "--subresource=status",
            "--type=merge",
            "-p",
            '{"status": {"phase": "Failed", "message": "boom"}}',
        )
        code, out, err = finished(job_wait("mine"))
        assert (code, out) == (1, "") and "failed: boom" in err, err
    finally:
        k8s_plane.kubectl(
            "delete", "tg", "mine", "other", "-n", ns, "--ignore-not-found", check=False
        )


# ---- helm upgrade / uninstall ------------------------------------------------------------------


def test_helm_upgrade_switches_between_clusterrole_and_roles(
    k8s_plane: KubePlane,
    crd: str,
    new_namespace: Callable[[str], str],
    watched: tuple[str, str],
) -> None:
    team_a, team_b = watched
    rel = install_chart(k8s_plane, "tgu", new_namespace("tgu-system"), {})
    try:
        cluster_role = f"{rel.fullname}-operator"
        assert exists(k8s_plane, "clusterrole", cluster_role)
        assert all(access(rel.kubeconfig, OPERATOR_NEEDS, namespace=team_b).values())

        # all namespaces -> one namespace: ClusterRole out, Role in, env follows
        rel.upgrade({"watchNamespaces": [team_a], "healthIntervalSeconds": 3}, wait=True)
        assert not exists(k8s_plane, "clusterrole", cluster_role)
        assert not exists(k8s_plane, "clusterrolebinding", cluster_role)
        assert exists(k8s_plane, "role", cluster_role, team_a)
        assert exists(k8s_plane, "rolebinding", cluster_role, team_a)
        env = rel.operator_env()
        assert env["TG_NAMESPACES"] == team_a and env["TG_HEALTH_INTERVAL_SECONDS"] == "3"
        assert all(access(rel.kubeconfig, OPERATOR_NEEDS, namespace=team_a).values())
        assert not any(access(rel.kubeconfig, OPERATOR_NEEDS, namespace=team_b).values())
        assert not any(access(rel.kubeconfig, TG_NEEDS_CLUSTER_WIDE, namespace=None).values())
        deploy = k8s_plane.kubectl_json("get", "deployment", rel.deployment, "-n", rel.namespace)
        assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"

        # a bad value is refused by the schema and leaves the release as it was
        proc = k8s_plane.helm(
            "upgrade",
            rel.release,
            str(CHART),
            "-n",
            rel.namespace,
            "--reuse-values",
            "--set",
            "bogus=1",
            check=False,
        )
        assert proc.returncode != 0 and "additional properties 'bogus' not allowed" in proc.stderr
        history = json.loads(
            k8s_plane.helm("history", rel.release, "-n", rel.namespace, "-o", "json").stdout
        )
        assert [h["revision"] for h in history] == [1, 2] and history[-1]["status"] == "deployed"

        # and back: Role out, ClusterRole in
        rel.upgrade({}, wait=True)
        assert exists(k8s_plane, "clusterrole", cluster_role)
        assert not exists(k8s_plane, "role", cluster_role, team_a)
        assert all(access(rel.kubeconfig, OPERATOR_NEEDS, namespace=team_b).values())
        assert rel.operator_env()["TG_NAMESPACES"] == ""
    finally:
        rel.uninstall()


def test_helm_uninstall_leaves_the_crd_and_finalized_trainergroups(
    k8s_plane: KubePlane,
    crd: str,
    new_namespace: Callable[[str], str],
    watched: tuple[str, str],
) -> None:
    """What docs/deploy.md says happens when the operator goes before its TrainerGroups:
    the CRD and the TrainerGroups stay; deleting one hangs on the finalizer until the
    operator is back or the finalizer is removed by hand."""
    ns = watched[1]
    rel = install_chart(k8s_plane, "tgx", new_namespace("tgx-system"), {}, wait=True)
    k8s_plane.apply(trainergroup("left-behind", ns))
    try:
        _uninstall_with_a_finalized_trainergroup_left(k8s_plane, rel, crd, ns)
    finally:
        k8s_plane.kubectl(
            "patch",
            "tg",
            "left-behind",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"metadata": {"finalizers": null}}',
            check=False,
        )
        k8s_plane.kubectl(
            "delete",
            "tg",
            "left-behind",
            "-n",
            ns,
            "--ignore-not-found",
            "--wait=false",
            check=False,
        )
        k8s_plane.helm("uninstall", "tgx", "-n", rel.namespace, check=False)


def _uninstall_with_a_finalized_trainergroup_left(
    k8s_plane: KubePlane, rel: ChartRelease, crd: str, ns: str
) -> None:
    # what the running operator does first: add its finalizer (with its own token)
    ok, out = kubectl_as(
        k8s_plane,
        rel.kubeconfig,
        "patch",
        "tg",
        "left-behind",
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"metadata": {"finalizers": [FINALIZER]}}),
    )
    assert ok, out

    rel.uninstall()
    for kind, name, namespace in (
        ("deployment", rel.deployment, rel.namespace),
        ("serviceaccount", rel.operator_service_account, rel.namespace),
        ("clusterrole", f"{rel.fullname}-operator", None),
        ("clusterrolebinding", f"{rel.fullname}-operator", None),
        ("service", f"{rel.fullname}-operator-metrics", rel.namespace),
    ):
        assert not exists(k8s_plane, kind, name, namespace), f"{kind}/{name} survived uninstall"
    assert exists(k8s_plane, "crd", crd), "helm must never delete the CRD (crds/)"
    assert exists(k8s_plane, "tg", "left-behind", ns)
    # the operator's identity lost every grant with its ServiceAccount and bindings
    # (Unauthorized once the API server has noticed the ServiceAccount is gone)
    ok, out = kubectl_as(k8s_plane, rel.kubeconfig, "get", "tg", "-n", ns)
    assert not ok and ("Forbidden" in out or "Unauthorized" in out), out

    k8s_plane.kubectl("delete", "tg", "left-behind", "-n", ns, "--wait=false")
    obj = k8s_plane.kubectl_json("get", "tg", "left-behind", "-n", ns)
    assert obj["metadata"].get("deletionTimestamp") and obj["metadata"]["finalizers"] == [FINALIZER]

    # reinstalling works with the CRD already there (helm skips existing crds/)
    again = install_chart(k8s_plane, "tgx", rel.namespace, {})
    try:
        assert exists(k8s_plane, "deployment", again.deployment, again.namespace)
    finally:
        again.uninstall()

    # the documented manual way out (after cleaning Ray by hand)
    k8s_plane.kubectl(
        "patch",
        "tg",
        "left-behind",
        "-n",
        ns,
        "--type=json",
        "-p",
        '[{"op": "remove", "path": "/metadata/finalizers"}]',
    )
    wait_until(
        lambda: not exists(k8s_plane, "tg", "left-behind", ns),
        timeout=30,
        what="the TrainerGroup to go once its finalizer is removed",
    )
