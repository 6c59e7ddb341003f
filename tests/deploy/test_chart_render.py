"""The Helm chart and manifests/, rendered and checked with real tools (helm, the Kubernetes
OpenAPI schemas, the CRD's schema). No cluster needed: see test_chart_k8s.py for the API server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

import tgapi
from tests.deploy.chart import (
    CHART,
    CRD_FILE,
    EXAMPLE_JOB,
    EXAMPLE_TG,
    MANIFESTS,
    REPO,
    by_kind,
    client_job_script,
    client_job_wait_command,
    contract_env_vars,
    crd,
    find_helm,
    one,
    operator_cluster_rules,
    operator_rules,
    rule_triples,
    run_helm,
    template,
)
from tg_operator import rbac
from tgruntime.entrypoints import client_job as tg_client

K8S_VERSION = "1.34.0"  # hack/versions.env KUBERNETES_VERSION's minor

NAMESPACED = {"watchNamespaces": ["team-a", "team-b"]}
EVERYTHING = {
    "watchNamespaces": ["team-a"],
    "metrics": {
        "port": 9191,
        "service": {"enabled": True, "type": "ClusterIP"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    },
    "clients": [
        {"name": "tg-client", "namespace": "team-a", "trainerGroups": ["a", "b"]},
        {"name": "tg-client-2", "trainerGroups": ["c"]},
    ],
    "extraEnv": [{"name": "EXTRA", "value": "1"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                        ]
                    }
                ]
            }
        }
    },
    "imagePullSecrets": [{"name": "regcred"}],
    "podAnnotations": {"a": "b"},
    "priorityClassName": "system-cluster-critical",
    "serviceAccount": {
        "create": True,
        "name": "custom-sa",
        "annotations": {"example.com/role": "operator"},
    },
}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": NAMESPACED,
    "everything": EVERYTHING,
}


# ---- helm lint and the values schema ---------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_strict(helm: str, variant: str, tmp_path: Path) -> None:
    vfile = tmp_path / "values.yaml"
    vfile.write_text(yaml.safe_dump(VARIANTS[variant]))
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(vfile), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    "setting, where",
    [
        ("bogus=1", "at '': additional properties 'bogus' not allowed"),
        ("image.bogus=1", "at '/image': additional properties 'bogus' not allowed"),
        ("rbac.bogus=1", "at '/rbac': additional properties 'bogus' not allowed"),
        (
            "metrics.serviceMonitor.bogus=1",
            "at '/metrics/serviceMonitor': additional properties 'bogus' not allowed",
        ),
        (
            "securityContext.bogus=1",
            "at '/securityContext': additional properties 'bogus' not allowed",
        ),
        (
            "clients[0].name=c,clients[0].trainerGroups[0]=x,clients[0].bogus=1",
            "at '/clients/0': additional properties 'bogus' not allowed",
        ),
        # typos of real keys are the point of rejecting unknown keys
        ("watchNamespace={a}", "additional properties 'watchNamespace' not allowed"),
        ("serviceaccount.create=false", "additional properties 'serviceaccount' not allowed"),
    ],
)
def test_values_schema_rejects_unknown_keys(helm: str, setting: str, where: str) -> None:
    proc = template(helm, extra=("--set", setting), check=False)
    assert isinstance(proc, subprocess.CompletedProcess), f"--set {setting} was accepted"
    assert proc.returncode != 0
    assert where in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "setting",
    [
        "watchNamespaces={Not_A_Namespace}",
        "image.pullPolicy=Sometimes",
        "healthIntervalSeconds=0",
        "metrics.port=70000",
        "livenessPort=0",
        "dashboardUrlTemplate=ftp://x",
        "clients[0].name=c",  # no trainerGroups
        "rbac.create=maybe",
    ],
)
def test_values_schema_rejects_bad_values(helm: str, setting: str) -> None:
    proc = template(helm, extra=("--set", setting), check=False)
    assert isinstance(proc, subprocess.CompletedProcess), f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr


# Objects whose inner shape is a Kubernetes type passed through as-is (not ours to close).
_OPAQUE = {
    "/global",
    "/extraEnv/items/valueFrom",
    "/affinity/nodeAffinity",
    "/affinity/podAffinity",
    "/affinity/podAntiAffinity",
}


def test_values_schema_is_closed_everywhere() -> None:
    """Every object in values.schema.json rejects unknown keys (additionalProperties false) or
    is a typed map; only the listed Kubernetes pass-through objects are open."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    problems: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if node.get("type") == "object" and path not in _OPAQUE:
            extra = node.get("additionalProperties")
            if "properties" in node and extra is not False:
                problems.append(
                    f"{path or '/'}: has properties but not additionalProperties: false"
                )
            if "properties" not in node and not isinstance(extra, dict):
                problems.append(f"{path or '/'}: an open object (no properties, untyped values)")
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}/{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}/items")
        for alt in node.get("anyOf", []):
            walk(alt, path)

    walk(schema, "")
    assert not problems, "\n".join(problems)


def test_values_yaml_keys_all_declared_and_valid() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, schema)
    declared = set(schema["properties"]) - {"global"}
    assert set(values) == declared, (
        f"values.yaml and values.schema.json disagree: only in values.yaml "
        f"{set(values) - declared}, only in the schema {declared - set(values)}"
    )


# ---- the rendered objects --------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_objects_match_kubernetes_schemas(helm: str, variant: str) -> None:
    """Every object `helm template` renders is valid (strict: no unknown fields) against the
    Kubernetes 1.34 OpenAPI schemas; the ServiceMonitor (a CRD) is checked by shape."""
    import kubernetes_validate as kv

    docs = template(helm, VARIANTS[variant])
    assert isinstance(docs, list) and docs
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert set(doc["spec"]) <= {"selector", "namespaceSelector", "endpoints"}, name
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(
                f"{variant}: {name} is not a valid {doc['apiVersion']} {doc['kind']}: "
                f"{getattr(exc, 'message', str(exc).splitlines()[0])} at "
                f"{list(getattr(exc, 'path', []))}"
            )


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples of a (Cluster)Role; resourceNames must be absent."""
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
    return rule_triples(role["rules"])


NAMESPACED_RULES = rule_triples(operator_rules())
CLUSTER_RULES = rule_triples(operator_cluster_rules())
CRD_RULES = {
    ("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("get", "list", "watch")
}


def test_operator_rules_are_the_operators_own_list(helm: str) -> None:
    """The chart grants what tg_operator.rbac declares, and that list stays small."""
    assert NAMESPACED_RULES, "tg_operator.rbac.OPERATOR_RULES is empty"
    assert not {r for _, r, _ in NAMESPACED_RULES} & {"configmaps", "*"}
    # Secrets: create only (each group's Ray token Secret); the operator reads none.
    assert {v for _, r, v in NAMESPACED_RULES if r == "secrets"} == {"create"}
    # The chart's RBAC template must not drift from the operator's declaration (both ways).
    # Cluster-scoped: get on Kueue's WorkloadPriorityClasses, nothing else.
    assert {("kueue.x-k8s.io", "workloadpriorityclasses", "get")} == CLUSTER_RULES
    docs = template_docs({})
    assert _rules(one(docs, "ClusterRole")) == NAMESPACED_RULES | CLUSTER_RULES


def test_operator_rules_for_the_tinker_server_are_create_and_a_watch(helm: str) -> None:
    """The Tinker API server's objects: created once, never read (Secrets), never deleted (the
    garbage collector removes them with the TrainerGroup); the Deployment is also listed and
    watched (an index), never fetched one by one, and patched when the spec changes its pod
    (rule update-tinker)."""
    verbs: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in NAMESPACED_RULES:
        verbs.setdefault((group, resource), set()).add(verb)
    assert verbs[("apps", "deployments")] == {"list", "watch", "create", "patch"}
    assert verbs[("", "services")] == {"create"}
    assert verbs[("", "serviceaccounts")] == {"create"}
    assert verbs[("", "secrets")] == {"create"}
    assert verbs[("rbac.authorization.k8s.io", "roles")] == {"create"}
    assert verbs[("rbac.authorization.k8s.io", "rolebindings")] == {"create"}
    assert verbs[("networking.k8s.io", "networkpolicies")] == {"create"}
    # no escalate/bind: the server's Role grants only what the operator holds itself
    assert not {v for _, _, v in NAMESPACED_RULES} & {"escalate", "bind", "impersonate", "*"}
    assert ("rbac.authorization.k8s.io", "clusterroles") not in verbs
    docs = template_docs({"watchNamespaces": ["team-a"]})
    assert _rules(one(docs, "Role")) == NAMESPACED_RULES


def test_rbac_all_namespaces_is_one_clusterrole(helm: str) -> None:
    docs = template(helm, {})
    assert isinstance(docs, list)
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")
    role = one(docs, "ClusterRole")
    assert _rules(role) == NAMESPACED_RULES | CLUSTER_RULES
    docs = template_docs({"rbac": {"create": True, "crdDiscovery": True}})
    assert _rules(one(docs, "ClusterRole")) == NAMESPACED_RULES | CLUSTER_RULES | CRD_RULES
    docs = template_docs({})
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = one(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": sa["metadata"]["name"],
            "namespace": "trainergroup-system",
        }
    ]
    env = _env(one(docs, "Deployment"))
    assert env["TG_NAMESPACES"] == ""


def test_rbac_listed_namespaces_get_a_role_each(helm: str) -> None:
    docs = template(helm, NAMESPACED)
    assert isinstance(docs, list)
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _rules(role) == NAMESPACED_RULES
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    for b in bindings:
        assert b["roleRef"]["kind"] == "Role"
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": sa, "namespace": "trainergroup-system"}
        ]
    # Nothing cluster-scoped by default; with crdDiscovery only read-only CRD access.
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert _env(one(docs, "Deployment"))["TG_NAMESPACES"] == "team-a,team-b"

    docs = template_docs({**NAMESPACED, "rbac": {"create": True, "crdDiscovery": True}})
    assert _rules(one(docs, "ClusterRole")) == CRD_RULES
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]
    docs = template(helm, {"rbac": {"create": False, "crdDiscovery": True}})
    assert isinstance(docs, list)
    assert not [d for d in docs if d["kind"].endswith(("Role", "RoleBinding"))]


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_rule_reaches_secrets_or_wildcards(helm: str, variant: str) -> None:
    docs = template(helm, VARIANTS[variant])
    assert isinstance(docs, list)
    for role in [d for d in docs if d["kind"] in ("Role", "ClusterRole")]:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
            assert not {"configmaps", "serviceaccounts/token"} & set(rule["resources"])
            if "secrets" in rule["resources"]:
                # the operator: create only (reads none); a client: get on named ones only
                assert rule["verbs"] == ["create"] or (
                    rule["verbs"] == ["get"] and rule.get("resourceNames")
                ), (role["metadata"]["name"], rule)
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def template_docs(values: dict[str, Any]) -> list[dict[str, Any]]:
    docs = template(find_helm(), values)
    assert isinstance(docs, list)
    return docs


def _env(deploy: dict[str, Any]) -> dict[str, str]:
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_deployment_is_single_and_hardened(helm: str) -> None:
    docs = template(helm, {})
    assert isinstance(docs, list)
    deploy = one(docs, "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc or sc["privileged"] is False
    # /tmp is the writable emptyDir.
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume
    # Liveness: kopf's /healthz on the contract's port 8080.
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[probe["port"]] == 8080
    assert ports["metrics"] == 9090
    assert container["image"] == "ghcr.io/trainergroup/operator:0.1.0"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    # The SA itself does not hand tokens to other pods; the operator's pod asks for one.
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False


def test_deployment_env_is_the_contract(helm: str) -> None:
    """Every operator setting of docs/contracts.md is set by the chart, to the documented
    default, and follows the values."""
    documented = contract_env_vars()
    assert len(documented) >= 8, documented
    docs = template(helm, {})
    assert isinstance(docs, list)
    env = _env(one(docs, "Deployment"))
    missing = set(documented) - set(env)
    assert not missing, f"the chart does not set {sorted(missing)} (docs/contracts.md)"
    for name, default in documented.items():
        m = re.fullmatch(r"`([^`]*)`", default)
        if m:
            assert env[name] == m.group(1), f"{name}: chart {env[name]!r}, contract {default}"
        elif default.startswith("empty"):
            assert env[name] == "", name

    custom = {
        "watchNamespaces": ["ns-x", "ns-y"],
        "dashboardUrlTemplate": "http://127.0.0.1:8265",
        "gcsAddressTemplate": "127.0.0.1:6379",
        "healthIntervalSeconds": 2.5,
        "watchTimeoutSeconds": 60,
        "pythonExecutable": "/usr/bin/python3",
        "livenessPort": 8181,
        "metrics": {
            "port": 9191,
            "service": {"enabled": True},
            "serviceMonitor": {"enabled": False},
        },
    }
    docs = template(helm, custom)
    assert isinstance(docs, list)
    deploy = one(docs, "Deployment")
    env = _env(deploy)
    assert env["TG_NAMESPACES"] == "ns-x,ns-y"
    assert env["TG_DASHBOARD_URL_TEMPLATE"] == "http://127.0.0.1:8265"
    assert env["TG_GCS_ADDRESS_TEMPLATE"] == "127.0.0.1:6379"
    assert env["TG_HEALTH_INTERVAL_SECONDS"] == "2.5"
    assert env["TG_WATCH_TIMEOUT_SECONDS"] == "60"
    assert env["TG_PYTHON"] == "/usr/bin/python3"
    assert env["TG_LIVENESS_PORT"] == "8181"
    assert env["TG_METRICS_PORT"] == "9191"
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "healthz": 8181,
        "metrics": 9191,
    }
    # The operator's own parser accepts what the chart renders.
    from tg_operator import settings
    config = settings.OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert config.namespaces == ("ns-x", "ns-y")
    assert config.liveness_port == 8181 and config.metrics_port == 9191


def test_metrics_service_and_servicemonitor_select_the_operator(helm: str) -> None:
    docs = template(helm, EVERYTHING)
    assert isinstance(docs, list)
    deploy = one(docs, "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = one(docs, "Service")
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port == {"name": "metrics", "port": 9191, "targetPort": "metrics", "protocol": "TCP"}
    sm = one(docs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["trainergroup-system"]}
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"

    docs = template(helm, {})
    assert isinstance(docs, list) and not by_kind(docs, "ServiceMonitor")
    off = {
        "metrics": {
            "port": 9090,
            "service": {"enabled": False},
            "serviceMonitor": {"enabled": False},
        }
    }
    docs = template(helm, off)
    assert isinstance(docs, list) and not by_kind(docs, "Service")
    bad = {
        "metrics": {
            "port": 9090,
            "service": {"enabled": False},
            "serviceMonitor": {"enabled": True},
        }
    }
    proc = template(helm, bad, check=False)
    assert isinstance(proc, subprocess.CompletedProcess)
    assert "a ServiceMonitor scrapes a Service" in proc.stderr


def test_client_rbac_reads_named_trainergroups_only(helm: str) -> None:
    docs = template(helm, EVERYTHING)
    assert isinstance(docs, list)
    clients = [
        d
        for d in docs
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "client"
    ]
    by = {(d["kind"], d["metadata"]["namespace"], d["metadata"]["name"]): d for d in clients}
    assert set(by) == {
        ("ServiceAccount", "team-a", "tg-client"),
        ("Role", "team-a", "tg-client"),
        ("RoleBinding", "team-a", "tg-client"),
        # no namespace: the release namespace
        ("ServiceAccount", "trainergroup-system", "tg-client-2"),
        ("Role", "trainergroup-system", "tg-client-2"),
        ("RoleBinding", "trainergroup-system", "tg-client-2"),
    }
    role = by[("Role", "team-a", "tg-client")]
    # the named groups' Ray tokens and Tinker API keys, and no other Secret
    SECRETS = ["a-ray-token", "a-tinker-keys", "b-ray-token", "b-tinker-keys"]
    # the operator's CLIENT_RULES (what the client's waiter needs), limited to the named groups
    assert role["rules"] == [
        *({**rule, "resourceNames": ["a", "b"]} for rule in rbac.CLIENT_RULES),
        *(
            {**rule, "resourceNames": SECRETS}
            for rule in rbac.CLIENT_TOKEN_RULES
        ),
    ]
    assert role["rules"] == [
        {
            "apiGroups": ["trainergroup.io"],
            "resources": ["trainergroups"],
            "resourceNames": ["a", "b"],
            "verbs": ["get", "watch"],
        },
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": SECRETS,
            "verbs": ["get"],
        },
    ]
    binding = by[("RoleBinding", "team-a", "tg-client")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "tg-client", "namespace": "team-a"}
    ]
    assert binding["roleRef"]["name"] == "tg-client"
    assert not by_kind(template(helm, {}), "RoleBinding")  # type: ignore[arg-type]


def test_image_defaults_to_the_app_version(helm: str) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    docs = template(helm, {"image": {"repository": "reg/op", "tag": "9.9", "pullPolicy": "Always"}})
    assert isinstance(docs, list)
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/op:9.9" and container["imagePullPolicy"] == "Always"


# ---- manifests/ and the CRD: one source each -------------------------------------------------


def test_manifests_are_rendered_from_the_chart(helm: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "charts" / "render_manifests.py"), "--check"],
        capture_output=True,
        text=True,
        env={**os.environ, "HELM": helm},
        check=False,
    )
    assert proc.returncode == 0, (
        "manifests/ differs from the chart's render; run `make chart-manifests`\n"
        + proc.stdout[-4000:]
        + proc.stderr
    )


def test_crd_copies_are_the_generated_one() -> None:
    from tgapi import crd as crdgen

    generated = crdgen.render()
    for path in (CRD_FILE, MANIFESTS / "crd" / "trainergroups.yaml"):
        assert path.read_text() == generated, f"{path} is stale: run `python -m tgapi.crd .`"


@pytest.mark.parametrize(
    "path", sorted(p.relative_to(MANIFESTS).as_posix() for p in MANIFESTS.rglob("*.yaml"))
)
def test_every_manifest_is_valid(path: str) -> None:
    """Every object under manifests/ is valid: built-in kinds against the Kubernetes schemas
    (strict), TrainerGroups against the CRD's schema, the CRD against apiextensions/v1."""
    import kubernetes_validate as kv

    docs = [d for d in yaml.safe_load_all((MANIFESTS / path).read_text()) if d]
    assert docs, f"{path} is empty"
    for doc in docs:
        if doc["kind"] == "TrainerGroup":
            _validate_against_crd(doc)
            continue
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(
                f"{path}: {doc['kind']}/{doc['metadata']['name']}: "
                f"{getattr(exc, 'message', str(exc).splitlines()[0])}"
            )


# ---- the examples ----------------------------------------------------------------------------


def _crd_schema() -> dict[str, Any]:
    (version,) = crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def _validate_against_crd(doc: dict[str, Any]) -> None:
    """jsonschema over the CRD's openAPIV3Schema (CEL rules are checked by the API server in
    test_chart_k8s.py, and by tgapi here)."""
    jsonschema.Draft4Validator(_crd_schema()).validate(doc)


def test_example_trainergroup_is_the_seed_shape() -> None:
    tg = tgapi.load_file(EXAMPLE_TG)
    s = tg.spec
    assert (tg.name, tg.namespace) == ("llama-tp2", "default")
    assert s.workers.processes_per_node == [2] and s.world_size == 2
    assert s.parallelism.tensor == 2 and s.data_parallel == 1
    assert s.ray_cluster is not None and s.ray_cluster_ref is None
    assert s.ray_cluster.workers.replicas == 1 and s.ray_cluster.workers.gpus_per_worker == 2
    assert s.workers.use_gpu
    m = s.model
    assert (
        m.vocab_size,
        m.hidden_size,
        m.num_layers,
        m.num_attention_heads,
        m.ffn_hidden_size,
        m.max_sequence_length,
        m.dtype,
    ) == (256, 2048, 24, 16, 5504, 1024, "bfloat16")
    assert (s.training.batch_size, s.training.sequence_length) == (16, 1024)
    assert (s.optimizer.lr, s.optimizer.clip_grad) == (1e-6, 1.0)
    assert s.ray_version == "2.60.0"


def test_example_trainergroup_matches_the_crd_schema() -> None:
    doc = yaml.safe_load(EXAMPLE_TG.read_text())
    _validate_against_crd(doc)
    # The schema is not a rubber stamp: a wrong enum or type in the example would fail.
    bad = yaml.safe_load(EXAMPLE_TG.read_text())
    bad["spec"]["model"]["dtype"] = "fp8"
    with pytest.raises(jsonschema.ValidationError, match="fp8"):
        _validate_against_crd(bad)
    bad = yaml.safe_load(EXAMPLE_TG.read_text())
    bad["spec"]["workers"]["processesPerNode"] = [0]
    with pytest.raises(jsonschema.ValidationError):
        _validate_against_crd(bad)


def test_client_job_runs_the_client_against_the_example() -> None:
    import kubernetes_validate as kv

    job = yaml.safe_load(EXAMPLE_JOB.read_text())
    kv.validate(job, K8S_VERSION, strict=True)
    tg = tgapi.load_file(EXAMPLE_TG)
    pod = job["spec"]["template"]["spec"]
    assert job["metadata"]["namespace"] == tg.namespace
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TG_NAME"] == tg.name and env["TG_STEPS"] == "10"
    script = client_job_script()
    # waits for Ready, joins the Ray cluster as a resource-less node, then runs the client
    assert 'ray start --address="$ADDR" --num-cpus=0 --num-gpus=0' in script
    client = "python -m tgruntime.entrypoints.client_job"
    assert f'{client} --trainergroup "$TG_NAME" --k8s-namespace "$POD_NAMESPACE"' in script
    assert '--steps "$TG_STEPS"' in script
    assert script.index("ray start") < script.index(f"{client} --trainergroup")
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert proc.returncode == 0, proc.stderr
    # the address comes from the client's own `wait` subcommand, whose flags exist
    wait = shlex.split(client_job_wait_command())
    assert wait[:4] == ["python", "-m", "tgruntime.entrypoints.client_job", "wait"], wait
    wait_args = tg_client.build_wait_parser().parse_args(wait[4:])
    assert wait_args.print_address and wait_args.trainergroup == "$TG_NAME"
    assert wait_args.k8s_namespace == "$POD_NAMESPACE"
    # The client runs in the runtime image the workers run (same Ray, same Python).
    assert container["image"] == tg.spec.image
    # Its ServiceAccount is the one manifests/client/rbac.yaml lets read this TrainerGroup.
    rbac = [d for d in yaml.safe_load_all((MANIFESTS / "client" / "rbac.yaml").read_text()) if d]
    sa = one(rbac, "ServiceAccount")
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["metadata"]["namespace"] == tg.namespace
    role = one(rbac, "Role")
    assert role["rules"][0]["resourceNames"] == [tg.name]
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Ray's object store needs a real /dev/shm
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert vol["emptyDir"]["medium"] == "Memory"


def test_tinker_client_job_reaches_the_example_groups_server_with_its_key() -> None:
    """manifests/examples/tinker-client-job.yaml: the Service, the Secret and the label the
    operator's Tinker objects use for the example group (tg_operator.tinker)."""
    import kubernetes_validate as kv

    from tg_operator import networkpolicy, tinker

    job = yaml.safe_load((MANIFESTS / "examples" / "tinker-client-job.yaml").read_text())
    kv.validate(job, K8S_VERSION, strict=True)
    tg = tgapi.load_file(EXAMPLE_TG)
    assert tg.spec.api.tinker  # on by default
    pod = job["spec"]["template"]
    assert pod["metadata"]["labels"][networkpolicy.CLIENT_LABEL] == tg.name
    assert job["metadata"]["namespace"] == tg.namespace
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["TINKER_BASE_URL"]["value"] == tinker.base_url(tg)
    ref = env["TINKER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": tinker.keys_secret_name(tg), "key": tinker.FIRST_KEY}
    assert container["image"] == tg.spec.image
    assert pod["spec"]["automountServiceAccountToken"] is False
    script = container["args"][0]
    compile(script, "tinker-client-job", "exec")  # valid Python
    assert "tinker.ServiceClient()" in script and '"cross_entropy"' in script


def test_namespace_manifest_enforces_restricted_pod_security(helm: str) -> None:
    """The operator's pod passes the 'restricted' Pod Security Standard its namespace enforces
    (checked for real by the API server in test_chart_k8s.py)."""
    ns = yaml.safe_load((MANIFESTS / "namespace.yaml").read_text())
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    deploy = yaml.safe_load((MANIFESTS / "operator" / "deployment.yaml").read_text())
    assert deploy["metadata"]["namespace"] == ns["metadata"]["name"]
