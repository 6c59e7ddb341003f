"""Helpers for the deployment tests: render the Helm chart, install it into the local control
plane, and get kubeconfigs for the ServiceAccounts it creates.

Reusable by other suites (e.g. a test that runs the real operator process with the chart's
ServiceAccount token)::

    from tests.deploy.chart import install_chart

    release = install_chart(k8s_plane, "tg", "tg-system", {"watchNamespaces": [ns]})
    env = {"KUBECONFIG": str(release.kubeconfig), **release.operator_env()}
    ...                                   # run `python -m tg_operator` with env
    release.uninstall()
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:  # the fixture module is a pytest plugin; import it for types only
    from tests.fixtures_k8s import KubePlane

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "trainergroup"
CRD_FILE = CHART / "crds" / "trainergroups.yaml"
MANIFESTS = REPO / "manifests"
EXAMPLE_TG = MANIFESTS / "examples" / "trainergroup.yaml"
EXAMPLE_JOB = MANIFESTS / "examples" / "client-job.yaml"
CONTRACTS = REPO / "docs" / "contracts.md"

API = "trainergroup.io"
FINALIZER = "trainergroup.io/finalizer"


def _load_render_module() -> ModuleType:
    path = REPO / "charts" / "render_manifests.py"
    spec = importlib.util.spec_from_file_location("tg_render_manifests", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render_manifests = _load_render_module()


def client_job_script() -> str:
    """The shell script the example client Job runs."""
    job = yaml.safe_load(EXAMPLE_JOB.read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["bash", "-ceu"], container["command"]
    return str(container["args"][0])


def client_job_wait_command() -> str:
    """The command the client Job runs first (wait for Ready, print status.rayAddress), as the
    shell line inside ``ADDR="$(...)"``."""
    script = client_job_script()
    inner = script.split('ADDR="$(', 1)[1].split(')"\n', 1)[0]
    return inner.replace("\\\n", " ")


def find_helm() -> str:
    """The helm binary ($HELM, PATH, or the control plane's tool set); FileNotFoundError if none."""
    helm: str = render_manifests.find_helm()
    return helm


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


class HelmError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


_HELM_HOME = tempfile.mkdtemp(prefix="tg-helm-home-")
# helm template/lint need no repositories: keep them away from the user's ~/.config/helm.
HELM_ENV = {
    **os.environ,
    "HELM_CACHE_HOME": f"{_HELM_HOME}/cache",
    "HELM_CONFIG_HOME": f"{_HELM_HOME}/config",
    "HELM_DATA_HOME": f"{_HELM_HOME}/data",
}


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run helm with no cluster (template, lint, show); HelmError on failure when check."""
    cmd = [helm, *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, check=False, env=HELM_ENV
    )
    if check and proc.returncode != 0:
        raise HelmError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


def values_file(values: dict[str, Any] | None, directory: Path) -> Path:
    path = directory / "values.yaml"
    path.write_text(yaml.safe_dump(values or {}))
    return path


def template(
    helm: str,
    values: dict[str, Any] | None = None,
    *,
    release: str = "trainergroup",
    namespace: str = "trainergroup-system",
    extra: tuple[str, ...] = (),
    check: bool = True,
) -> list[dict[str, Any]] | subprocess.CompletedProcess[str]:
    """`helm template` with values; the parsed documents (or the failed process if check=False)."""
    with tempfile.TemporaryDirectory() as tmp:
        vfile = values_file(values, Path(tmp))
        proc = run_helm(
            helm,
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "-f",
            str(vfile),
            *extra,
            check=check,
        )
    if proc.returncode != 0:
        return proc
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def contract_env_vars() -> dict[str, str]:
    """The operator settings table of docs/contracts.md: variable -> documented default."""
    text = CONTRACTS.read_text()
    section = text.split("## Operator process settings", 1)[1].split("\n## ", 1)[0]
    out = {}
    for m in re.finditer(r"^\|\s*`(TG_[A-Z0-9_]+)`\s*\|\s*([^|]*)\|", section, re.M):
        out[m.group(1)] = m.group(2).strip()
    return out


def crd() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CRD_FILE.read_text())
    return doc


# ---------------------------------------------------------------------------------------------
# What the operator needs, and what it must not have (one list for every RBAC test)
# ---------------------------------------------------------------------------------------------


def rule_triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) for every combination a rule list grants."""
    return {
        (g, r, v)
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def as_check(group: str, resource: str, verb: str) -> tuple[str, str]:
    """(verb, "resource[.group][/subresource]") as kubectl auth can-i writes it."""
    base, _, sub = resource.partition("/")
    name = f"{base}.{group}" if group else base
    return verb, f"{name}/{sub}" if sub else name


def operator_rules() -> list[dict[str, Any]]:
    """The operator's own declaration of what it needs (tg_operator.rbac.OPERATOR_RULES)."""
    from tg_operator import rbac

    return rbac.OPERATOR_RULES


def operator_cluster_rules() -> list[dict[str, Any]]:
    """Its cluster-scoped reads (tg_operator.rbac.OPERATOR_CLUSTER_RULES): all-namespaces only."""
    from tg_operator import rbac

    return rbac.OPERATOR_CLUSTER_RULES


# (verb, resource[.group][/subresource]) the operator needs in each namespace it watches.
OPERATOR_NEEDS: list[tuple[str, str]] = sorted(as_check(*t) for t in rule_triples(operator_rules()))
# Optional cluster-scoped read (rbac.crdDiscovery).
CRD_DISCOVERY = [
    (v, "customresourcedefinitions.apiextensions.k8s.io") for v in ("get", "list", "watch")
]

# Requests outside the operator's job: each must be denied.
OPERATOR_DENIED: list[tuple[str, str]] = [
    ("get", "secrets"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("get", "configmaps"),
    ("create", "configmaps"),
    ("create", "trainergroups.trainergroup.io"),
    ("delete", "trainergroups.trainergroup.io"),
    ("deletecollection", "rayclusters.ray.io"),
    ("update", "rayclusters.ray.io"),
    ("delete", "trainergroups.trainergroup.io/status"),
    ("create", "pods"),
    ("delete", "pods"),
    ("create", "pods/exec"),
    ("get", "pods/log"),
    ("create", "serviceaccounts/token"),
    ("impersonate", "serviceaccounts"),
    # the Tinker server's objects: created once (tg_operator.tinker), never read or deleted by
    # the operator (the garbage collector removes them with the group); only the Deployment is
    # patched, when the spec changes its pod (rule update-tinker), never replaced with update
    ("get", "deployments.apps"),
    ("update", "deployments.apps"),
    ("delete", "deployments.apps"),
    ("get", "services"),
    ("patch", "services"),
    ("delete", "services"),
    ("update", "secrets"),
    ("patch", "secrets"),
    ("delete", "secrets"),
    ("update", "rolebindings.rbac.authorization.k8s.io"),
    ("delete", "roles.rbac.authorization.k8s.io"),
    ("escalate", "roles.rbac.authorization.k8s.io"),
    ("bind", "roles.rbac.authorization.k8s.io"),
    ("bind", "clusterroles.rbac.authorization.k8s.io"),
    ("create", "rayjobs.ray.io"),
]
OPERATOR_DENIED_CLUSTER = [
    ("list", "namespaces"),
    ("get", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("update", "customresourcedefinitions.apiextensions.k8s.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "namespaces"),
    ("delete", "namespaces"),
    ("get", "nodes"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("create", "clusterroles.rbac.authorization.k8s.io"),
]


# ---------------------------------------------------------------------------------------------
# Installing into the local control plane
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChartRelease:
    """A Helm release of charts/trainergroup in the local control plane."""

    plane: KubePlane
    release: str
    namespace: str
    values: dict[str, Any]
    kubeconfig: Path
    """Authenticates as the operator's ServiceAccount (a real TokenRequest token)."""

    @property
    def fullname(self) -> str:
        return self.release if "trainergroup" in self.release else f"{self.release}-trainergroup"

    @property
    def operator_service_account(self) -> str:
        return self.values.get("serviceAccount", {}).get("name") or f"{self.fullname}-operator"

    @property
    def deployment(self) -> str:
        return f"{self.fullname}-operator"

    @property
    def subject(self) -> str:
        """The operator's user name for `kubectl --as`."""
        return f"system:serviceaccount:{self.namespace}:{self.operator_service_account}"

    def operator_env(self) -> dict[str, str]:
        """The env the chart gives the operator container (values only, no valueFrom; the API
        server drops empty values, so those read as "")."""
        deploy = self.plane.kubectl_json("get", "deployment", self.deployment, "-n", self.namespace)
        container = deploy["spec"]["template"]["spec"]["containers"][0]
        return {
            e["name"]: e.get("value", "") for e in container.get("env", []) if "valueFrom" not in e
        }

    def client_kubeconfig(self, name: str, namespace: str | None = None) -> Path:
        """A kubeconfig for one of the chart's client ServiceAccounts (values `clients`)."""
        return self.plane.kubeconfig_for_service_account(namespace or self.namespace, name)

    def upgrade(self, values: dict[str, Any], *, wait: bool = False) -> ChartRelease:
        _helm_install(self.plane, "upgrade", self.release, self.namespace, values, wait=wait)
        self.values = values
        return self

    def uninstall(self, *, wait: bool = True) -> None:
        args = ["uninstall", self.release, "-n", self.namespace]
        if wait:
            args += ["--wait", "--timeout", "120s"]
        self.plane.helm(*args)


def _helm_install(
    plane: KubePlane,
    verb: str,
    release: str,
    namespace: str,
    values: dict[str, Any],
    *,
    wait: bool,
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as tmp:
        vfile = values_file(values, Path(tmp))
        args = [verb, release, str(CHART), "-n", namespace, "-f", str(vfile)]
        if verb == "install":
            args.append("--create-namespace")
        else:
            # `values` is the whole set: without this, an upgrade with empty values silently
            # keeps the previous release's values.
            args.append("--reset-values")
        if wait:
            args += ["--wait", "--timeout", "180s"]
        return plane.helm(*args)


def install_chart(
    plane: KubePlane,
    release: str,
    namespace: str,
    values: dict[str, Any] | None = None,
    *,
    wait: bool = False,
) -> ChartRelease:
    """`helm install` the chart (creating `namespace`); the release, with `.kubeconfig` for the
    operator's ServiceAccount.

    Helm installs the CRD from crds/ when it is absent (and never upgrades it). With
    wait=True helm waits for the Deployment to be available (on kwok the pod is faked).
    """
    values = dict(values or {})
    _helm_install(plane, "install", release, namespace, values, wait=wait)
    partial = ChartRelease(plane, release, namespace, values, Path())
    sa = partial.operator_service_account
    partial.kubeconfig = plane.kubeconfig_for_service_account(namespace, sa)
    return partial


def parse_check(resource: str) -> tuple[str, str, str]:
    """Split a rule's resource into (group, resource, subresource).

    "rayclusters.ray.io" -> ("ray.io", "rayclusters", ""); "pods/log" -> ("", "pods", "log").
    """
    base, _, sub = resource.partition("/")
    name, _, group = base.partition(".")
    return group, name, sub


def access(
    kubeconfig: Path,
    checks: list[tuple[str, str]],
    *,
    namespace: str | None,
    name: str | None = None,
) -> dict[tuple[str, str], bool]:
    """What the API server's authorizer answers for the kubeconfig's own identity (a real
    token: SelfSubjectAccessReview), for each (verb, "resource[.group][/subresource]").
    namespace None asks cluster-wide (all namespaces)."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]  # untyped in kubernetes
    try:
        authz = client.AuthorizationV1Api(api)
        out = {}
        for verb, resource in checks:
            group, plural, sub = parse_check(resource)
            attrs = client.V1ResourceAttributes(
                namespace=namespace,
                verb=verb,
                group=group,
                resource=plural,
                subresource=sub or None,
                name=name,
            )
            review = authz.create_self_subject_access_review(
                client.V1SelfSubjectAccessReview(
                    spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
                )
            )
            assert review.status is not None  # the API server always answers one
            out[(verb, resource)] = bool(review.status.allowed)
        return out
    finally:
        api.close()


def whoami(kubeconfig: Path) -> str:
    """The user name the API server authenticates the kubeconfig as (SelfSubjectReview)."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]  # untyped in kubernetes
    try:
        review = client.AuthenticationV1Api(api).create_self_subject_review(
            client.V1SelfSubjectReview()
        )
        assert review.status is not None and review.status.user_info is not None
        return str(review.status.user_info.username)
    finally:
        api.close()
