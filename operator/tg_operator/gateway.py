"""The Tinker gateway of a namespace (or of the cluster): pure builders.

One endpoint for every TrainerGroup's Tinker API (``python -m tgruntime.gateway``, docs/
tinker.md "One endpoint for the cluster: the gateway"). The operator keeps, per namespace
(``TG_GATEWAY=namespace``, the chart's default) or once in its own namespace
(``TG_GATEWAY=cluster``):

* ConfigMap ``tinker-gateway``: ``groups.json``, the groups whose ``status.apiURL`` is set,
  each with the base model names its spec serves (``spec.model.name``, the group's name,
  ``spec.model.pretrained``), re-written when a group's URL or names change. In namespace
  mode every TrainerGroup of the namespace owns it (non-controller owner references), so the
  garbage collector removes it with the last one; the gateway re-reads the mounted file;
* Deployment, Service, NetworkPolicy and ServiceAccount ``tinker-gateway``, created once,
  owned by the ConfigMap (so they go with it). The pod reads no Kubernetes API (no token is
  mounted, no RBAC), runs restricted (non-root, no capabilities, RuntimeDefault seccomp,
  read-only root), and admits pods labelled ``trainergroup.io/client`` (any value) on its
  port; each group's server admits its namespace's gateway pods (tinker.build_networkpolicy),
  and cluster-wide the operator adds a policy in each group namespace that admits the
  gateway's namespace (:func:`build_cross_namespace_ingress`).

The gateway holds no key: it forwards each caller's ``X-API-Key`` and the groups decide.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tg_operator import names, pods
from tg_operator.networkpolicy import CLIENT_LABEL

NAME = "tinker-gateway"
SERVER_LABEL = "trainergroup.io/tinker"  # tg_operator.tinker's (not imported: it imports this)
NAMESPACE_LABEL = "kubernetes.io/metadata.name"
GATEWAY_LABEL = "trainergroup.io/gateway"
"""On the gateway's pods: each group's Tinker NetworkPolicy admits pods with it."""
CONFIG_FILE = "groups.json"
CONFIG_DIR = "/etc/tinker-gateway"
PORT = 8000
MODES = ("namespace", "cluster", "off")
DEFAULT_RESOURCES = {"cpu": "500m", "memory": "512Mi"}


def group_entry(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the gateway needs of one TrainerGroup (its raw body): name, namespace, uid, the
    Tinker URL, the model names and the image; None while it has no ``status.apiURL``."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    url = (body.get("status") or {}).get("apiURL")
    if not url or meta.get("deletionTimestamp"):
        return None
    model = spec.get("model") or {}
    models = [m for m in (model.get("name"), meta.get("name"), model.get("pretrained")) if m]
    return {
        "name": str(meta.get("name")), "namespace": str(meta.get("namespace")),
        "uid": str(meta.get("uid")), "url": str(url), "models": list(dict.fromkeys(models)),
        "image": str(spec.get("image") or ""),
    }


def config_doc(entries: Iterable[Mapping[str, Any]], *, cluster: bool = False) -> dict[str, Any]:
    """``groups.json`` (tgruntime.gateway.groups.from_document): sorted, so an unchanged set
    writes the same bytes. Cluster-wide, a name is ``<namespace>.<name>``."""
    groups = [
        {
            "name": f"{e['namespace']}.{e['name']}" if cluster else e["name"],
            "url": e["url"], "models": list(e["models"]),
        }
        for e in entries
    ]
    return {"groups": sorted(groups, key=lambda g: str(g["name"]))}


def _labels() -> dict[str, str]:
    return {names.MANAGED_BY_LABEL: names.MANAGED_BY, GATEWAY_LABEL: "true"}


def tg_owner(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A non-controller owner reference to one TrainerGroup: the ConfigMap has one per group
    of the namespace and is collected once the last goes."""
    return {
        "apiVersion": names.TG_API_VERSION, "kind": names.TG_KIND, "name": entry["name"],
        "uid": entry["uid"], "controller": False, "blockOwnerDeletion": False,
    }


def build_configmap(
    namespace: str, entries: Sequence[Mapping[str, Any]], *, cluster: bool = False
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": NAME, "namespace": namespace, "labels": _labels()}
    if not cluster:
        meta["ownerReferences"] = [tg_owner(e) for e in sorted(entries, key=lambda e: e["name"])]
    doc = config_doc(entries, cluster=cluster)
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
        "data": {CONFIG_FILE: json.dumps(doc, indent=1, sort_keys=True)},
    }


def _meta(namespace: str, configmap_uid: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": NAME, "namespace": namespace, "labels": _labels()}
    if configmap_uid:
        meta["ownerReferences"] = [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": NAME, "uid": configmap_uid,
            "controller": True, "blockOwnerDeletion": True,
        }]
    return meta


def build_service_account(namespace: str, configmap_uid: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(namespace, configmap_uid),
        "automountServiceAccountToken": False,
    }


def build_service(namespace: str, configmap_uid: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(namespace, configmap_uid),
        "spec": {
            "type": "ClusterIP", "selector": {GATEWAY_LABEL: "true"},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_networkpolicy(
    namespace: str, configmap_uid: str | None, *, cluster: bool = False
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
        "metadata": _meta(namespace, configmap_uid),
        "spec": {
            "podSelector": {"matchLabels": {GATEWAY_LABEL: "true"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [peer], "ports": [{"protocol": "TCP", "port": PORT}]}],
        },
    }


def build_deployment(
    namespace: str, configmap_uid: str | None, *, image: str, python: str,
    resources: Mapping[str, str] | None = None, run_as_user: int = 1000,
) -> dict[str, Any]:
    """One replica (sessions live in the groups; what the gateway learns is soft state, so a
    replacement pod carries on), restricted pod security, probes on ``/healthz``."""
    res = dict(resources or DEFAULT_RESOURCES)
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10,
             "timeoutSeconds": 5}
    security = {**pods.container_security(), "readOnlyRootFilesystem": True}
    container = {
        "name": "gateway", "image": image,
        "command": [python, "-m", "tgruntime.gateway", "--config",
                    f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": {"requests": dict(res), "limits": dict(res)},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": security,
    }
    pod = {
        "serviceAccountName": NAME, "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": NAME}},
                    {"name": "tmp", "emptyDir": {}}],
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": run_as_user, "runAsGroup": run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(namespace, configmap_uid),
        "spec": {
            "replicas": 1, "selector": {"matchLabels": {GATEWAY_LABEL: "true"}},
            "template": {"metadata": {"labels": _labels()}, "spec": pod},
        },
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
    namespace: str, configmap_uid: str | None, *, image: str, python: str,
    cluster: bool = False,
) -> tuple[dict[str, Any], ...]:
    """What is created once besides the ConfigMap, owned by it."""
    return (
        build_service_account(namespace, configmap_uid),
        build_service(namespace, configmap_uid),
        build_networkpolicy(namespace, configmap_uid, cluster=cluster),
        build_deployment(namespace, configmap_uid, image=image, python=python),
    )


def base_url(namespace: str) -> str:
    """``TINKER_BASE_URL`` for every group of the namespace (or the cluster)."""
    return f"http://{NAME}.{namespace}.svc:{PORT}"
