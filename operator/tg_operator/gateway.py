"""The Tinker gateway of a namespace (or of the cluster): pure builders.

One endpoint for every TrainerGroup's Tinker API (``python -m tgruntime.gateway``, docs/
tinker.md "One endpoint for the cluster: the gateway"). The gateway finds the groups itself:
it lists the TrainerGroups of its namespace (``--trainergroups NS``; ``*`` cluster-wide) and
routes to each one whose ``status.apiURL`` is set, by the model names of its spec. So the
operator writes no list and needs no verb it did not have: per namespace with TrainerGroups
(``TG_GATEWAY=namespace``, the chart's default) it creates once

* Deployment ``tinker-gateway``, owned by every TrainerGroup of the namespace (non-controller
  owner references, merged in as groups come: the garbage collector removes it with the last
  one), one replica, restricted pod (non-root, no capabilities, RuntimeDefault seccomp,
  read-only root);
* owned by the Deployment: ServiceAccount, Role and RoleBinding ``tinker-gateway`` (get, list
  and watch on TrainerGroups, nothing else: what the operator holds itself), Service
  ``tinker-gateway`` (port 8000) and NetworkPolicy ``tinker-gateway`` (pods labelled
  ``trainergroup.io/client``, any value, reach the port). Each group's server admits its
  namespace's gateway pods (tinker.build_networkpolicy).

Cluster-wide (``TG_GATEWAY=cluster``) the operator creates the same in its own namespace with
``--trainergroups '*'``, minus the Role (the chart grants the ClusterRole: an operator cannot
grant cluster-wide reads), and a NetworkPolicy ``tinker-gateway-ingress`` in each group
namespace that admits the gateway's namespace.

The gateway holds no key: it forwards each caller's ``X-API-Key`` and the groups decide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tg_operator import names, pods, probes
from tg_operator.networkpolicy import CLIENT_LABEL

NAME = "tinker-gateway"
SERVER_LABEL = "trainergroup.io/tinker"  # tg_operator.tinker's (not imported: it imports this)
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
GATEWAY_LABEL = "trainergroup.io/gateway"
"""On the gateway's pods: each group's Tinker NetworkPolicy admits pods with it."""
PORT = 8000
MODES = ("namespace", "cluster", "off")
REQUESTS = {"cpu": "50m", "memory": "128Mi"}  # small: it forwards bytes, it holds none
LIMITS = {"cpu": "1", "memory": "512Mi"}


STARTUP_LIMIT_S = 300  # the gateway's start: imports and its first TrainerGroup list


def group_entry(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the operator needs of one TrainerGroup (its raw body) for the gateway: name,
    namespace, uid and image; None while it is being deleted."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    if meta.get("deletionTimestamp") or not meta.get("uid"):
        return None
    return {
        "name": str(meta.get("name")), "namespace": str(meta.get("namespace")),
        "uid": str(meta.get("uid")), "image": str(spec.get("image") or ""),
    }


def _labels() -> dict[str, str]:
    return {names.MANAGED_BY_LABEL: names.MANAGED_BY, GATEWAY_LABEL: "true"}


def tg_owner(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A non-controller owner reference to one TrainerGroup: the Deployment has one per group
    of the namespace and is collected once the last goes."""
    return {
        "apiVersion": names.TG_API_VERSION, "kind": names.TG_KIND, "name": entry["name"],
        "uid": entry["uid"], "controller": False, "blockOwnerDeletion": False,
    }


def owners_of(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [tg_owner(e) for e in sorted(entries, key=lambda e: str(e["name"]))]


def _meta(namespace: str, deployment_uid: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": NAME, "namespace": namespace, "labels": _labels()}
    if deployment_uid:
        meta["ownerReferences"] = [{
            "apiVersion": "apps/v1", "kind": "Deployment", "name": NAME, "uid": deployment_uid,
            "controller": True, "blockOwnerDeletion": True,
        }]
    return meta


def build_service_account(namespace: str, deployment_uid: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(namespace, deployment_uid),
        "automountServiceAccountToken": False,
    }


def build_service(namespace: str, deployment_uid: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(namespace, deployment_uid),
        "spec": {
            "type": "ClusterIP", "selector": {GATEWAY_LABEL: "true"},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_networkpolicy(
    namespace: str, deployment_uid: str | None, *, cluster: bool = False
) -> dict[str, Any]:
    """Pods labelled ``trainergroup.io/client`` (any group) reach the gateway's port (from
    every namespace, cluster-wide); nothing else does."""
    peer: dict[str, Any] = {
        "podSelector": {"matchExpressions": [{"key": CLIENT_LABEL, "operator": "Exists"}]}
    }
    if cluster:
        peer["namespaceSelector"] = {}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(namespace, deployment_uid),
        "spec": {
            "podSelector": {"matchLabels": {GATEWAY_LABEL: "true"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [peer], "ports": [{"protocol": "TCP", "port": PORT}]}],
        },
    }


def build_deployment(
    namespace: str, entries: Sequence[Mapping[str, Any]], *, image: str, python: str,
    cluster: bool = False, run_as_user: int = 1000,
) -> dict[str, Any]:
    """One replica (sessions live in the groups; what the gateway learns is soft state, so a
    replacement pod carries on), restricted, probes on ``/healthz``; owned by the namespace's
    TrainerGroups (none cluster-wide)."""
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
             "timeoutSeconds": 5}
    security = {**pods.container_security(), "readOnlyRootFilesystem": True}
    container = {
        "name": "gateway", "image": image,
        "command": [python, "-m", "tgruntime.gateway", "--trainergroups",
                    "*" if cluster else namespace, "--host", "0.0.0.0", "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        # until healthz first answers (the Python start takes seconds on a small CPU share),
        # one waiting exec and no other probe: a normal start posts no Unhealthy event (the
        # kind suite's gateway phase failed on a readiness probe that came first)
        "startupProbe": probes.startup_wait(
            probes.http_200(port=PORT, path="/healthz"), limit_s=STARTUP_LIMIT_S
        ),
        "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {"requests": dict(REQUESTS), "limits": dict(LIMITS)},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": security,
    }
    pod = {
        # the token lists TrainerGroups (the Role below); only this pod mounts it
        "serviceAccountName": NAME, "automountServiceAccountToken": True,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": run_as_user, "runAsGroup": run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    meta = _meta(namespace, None)
    if not cluster:
        meta["ownerReferences"] = owners_of(entries)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {
            "replicas": 1, "selector": {"matchLabels": {GATEWAY_LABEL: "true"}},
            "template": {"metadata": {"labels": _labels()}, "spec": pod},
        },
    }


TRAINERGROUP_READS = {
    "apiGroups": [names.GROUP], "resources": [names.TG_PLURAL], "verbs": ["get", "list", "watch"],
}
"""The gateway's one permission (its Role; cluster-wide, the chart's ClusterRole)."""


def build_role(namespace: str, deployment_uid: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": _meta(namespace, deployment_uid), "rules": [dict(TRAINERGROUP_READS)],
    }


def build_role_binding(namespace: str, deployment_uid: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": _meta(namespace, deployment_uid),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": NAME},
        "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": namespace}],
    }


def build_cross_namespace_ingress(group_namespace: str, gateway_namespace: str) -> dict[str, Any]:
    """Cluster mode: in a group's namespace, its Tinker servers (label
    ``trainergroup.io/tinker``) admit the gateway's pods of ``gateway_namespace`` on their
    port (the groups' own policies admit only their namespace's pods). Created once, owned by
    nothing (it stays when the namespace's groups go)."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{NAME}-ingress", "namespace": group_namespace,
                     "labels": _labels()},
        "spec": {
            "podSelector": {"matchExpressions": [{"key": SERVER_LABEL, "operator": "Exists"}]},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{
                "podSelector": {"matchLabels": {GATEWAY_LABEL: "true"}},
                "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: gateway_namespace}},
            }]}],
        },
    }


def image_of(entries: Sequence[Mapping[str, Any]], configured: str) -> str:
    """The gateway's image: the chart's ``gateway.image`` (TG_GATEWAY_IMAGE), else the runtime
    image of the first group by name (the gateway's code ships in it)."""
    if configured:
        return configured
    found = [e["image"] for e in sorted(entries, key=lambda e: e["name"]) if e.get("image")]
    return found[0] if found else ""


def objects(
    namespace: str, deployment_uid: str | None, *, cluster: bool = False
) -> tuple[dict[str, Any], ...]:
    """What is created once besides the Deployment, owned by it (cluster-wide: no Role, the
    chart binds the ClusterRole)."""
    rbac = () if cluster else (
        build_role(namespace, deployment_uid), build_role_binding(namespace, deployment_uid)
    )
    return (
        build_service_account(namespace, deployment_uid),
        *rbac,
        build_service(namespace, deployment_uid),
        build_networkpolicy(namespace, deployment_uid, cluster=cluster),
    )


def base_url(namespace: str) -> str:
    """``TINKER_BASE_URL`` for every group of the namespace (or the cluster)."""
    return f"http://{NAME}.{namespace}.svc:{PORT}"
