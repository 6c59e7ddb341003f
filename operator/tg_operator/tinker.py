"""The objects that serve a group's Tinker API (``spec.api.tinker``): pure builders.

For a TrainerGroup ``NAME`` the operator creates, all owned by the TrainerGroup (the
garbage collector removes them with it) and created once (an existing object is left as it
is; the Deployment, made last, is what a pass looks for):

* ServiceAccount ``NAME-tinker`` with a Role and RoleBinding ``NAME-tinker``: ``get`` and
  ``watch`` on this TrainerGroup only (the server reads its status to attach);
* Secret ``NAME-tinker-keys``: one random key ``tml-...`` under the key ``default``, never
  overwritten (create answers 409 once it exists; the operator reads no Secret). Users add
  keys to it; the server reads every file of the mounted volume, so a key removed from the
  Secret stops working once the kubelet syncs the volume;
* Service ``NAME-tinker`` (the API's port, 8000 by default);
* NetworkPolicy ``NAME-tinker``: the server pod admits pods labelled
  ``trainergroup.io/client=NAME`` and the namespace's Tinker gateway
  (``trainergroup.io/gateway``, tg_operator.gateway) on the API's port, and the group's Ray
  pods (the server is a Ray driver: workers call back into it), nothing else;
* Deployment ``NAME-tinker``: one pod from the group's runtime image running
  ``python -m tgruntime.service --trainergroup NAME --k8s-namespace NS --host 0.0.0.0 --port
  PORT --keys-dir KEYS_DIR`` (docs/tinker.md) with the keys Secret mounted at
  :data:`KEYS_DIR`, the Ray token from ``NAME-ray-token``, and the label
  ``trainergroup.io/client=NAME`` (the group's Ray NetworkPolicy admits it).

``status.apiURL`` (``http://NAME-tinker.NS.svc:PORT``) is published once the Deployment is
available (:func:`api_url`).

``spec.api.adminPrincipals`` reaches the server as ``--admin-principals a,b``. With
``spec.api.tls.secretName`` the pod mounts that Secret (``tls.crt``/``tls.key``, the
kubernetes.io/tls layout, e.g. a cert-manager Certificate's) at :data:`TLS_DIR`, the server
gets ``--tls-cert``/``--tls-key`` and speaks only HTTPS, its probes use HTTPS, and
``status.apiURL`` starts with ``https://``. The operator never reads that Secret; a pod whose
Secret does not exist yet waits in ContainerCreating (the kubelet's event names it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

from tg_operator import names, owners, platform, pods, probes, ray_token
from tg_operator.gateway import GATEWAY_LABEL
from tg_operator.networkpolicy import CLIENT_LABEL
from tgapi import TrainerGroup

SERVER_LABEL = "trainergroup.io/tinker"
"""On the server's pods and its Deployment: the group's name (the watch's label filter)."""
HASH_ANNOTATION = "trainergroup.io/tinker-hash"
STARTUP_PERIOD_S = 10
STARTUP_LIMIT_S = 1800
"""How long the server pod may take to start (waiting for the group included) before the
kubelet restarts it."""
SUFFIX = "-tinker"
KEYS_SUFFIX = "-tinker-keys"
FIRST_KEY = "default"
"""The Secret's key that holds the operator's random key (users add others beside it)."""
KEY_PREFIX = "tml-"
KEYS_DIR = "/etc/tinker/keys"
"""Where the server pod mounts the keys Secret (``--keys-dir``; also ``TG_TINKER_KEYS_DIR``)."""
KEYS_DIR_ENV = "TG_TINKER_KEYS_DIR"
TLS_DIR = "/etc/tinker/tls"
"""Where the server pod mounts ``spec.api.tls.secretName`` (tls.crt, tls.key)."""
SERVICE_MODULE = "tgruntime.service"
PORT_NAME = "http"


def wanted(tg: TrainerGroup) -> bool:
    return tg.spec.api.tinker


def server_name(tg: TrainerGroup) -> str:
    """The Deployment, Service, ServiceAccount, Role, RoleBinding and NetworkPolicy."""
    return f"{tg.name}{SUFFIX}"


def keys_secret_name(tg: TrainerGroup) -> str:
    return f"{tg.name}{KEYS_SUFFIX}"


def port(tg: TrainerGroup) -> int:
    return tg.spec.api.server.port


def base_url(tg: TrainerGroup) -> str:
    """``TINKER_BASE_URL`` inside the cluster: the Service's DNS name."""
    return f"{scheme(tg)}://{server_name(tg)}.{tg.namespace}.svc:{port(tg)}"


def scheme(tg: TrainerGroup) -> str:
    """``https`` with ``spec.api.tls``, else ``http``."""
    return "https" if tg.spec.api.tls is not None else "http"


def new_api_key() -> str:
    """A random API key: ``tml-`` and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _metadata(tg: TrainerGroup, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": tg.namespace,
        "labels": {**names.labels(tg), SERVER_LABEL: tg.name},
        "ownerReferences": [owners.owner_reference(tg)],
    }


def server_selector(tg: TrainerGroup) -> dict[str, str]:
    return {SERVER_LABEL: tg.name}


# -- the server's identity: reads its own TrainerGroup, nothing else ----------------------
def build_service_account(tg: TrainerGroup) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(tg, server_name(tg)),
    }


def build_role(tg: TrainerGroup) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(tg, server_name(tg)),
        "rules": [
            {
                "apiGroups": [names.GROUP],
                "resources": [names.TG_PLURAL],
                "resourceNames": [tg.name],
                "verbs": ["get", "watch"],
            }
        ],
    }


def build_role_binding(tg: TrainerGroup) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(tg, server_name(tg)),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": server_name(tg),
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": server_name(tg), "namespace": tg.namespace}
        ],
    }


# -- keys, Service, NetworkPolicy ------------------------------------------------------------
def build_keys_secret(tg: TrainerGroup, *, key: str) -> dict[str, Any]:
    """The keys Secret with its first key (created once: an existing one is never replaced)."""
    if not key.startswith(KEY_PREFIX):
        raise ValueError(f"a Tinker API key starts with {KEY_PREFIX!r}")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(tg, keys_secret_name(tg)),
        "data": {FIRST_KEY: base64.b64encode(key.encode()).decode()},
    }


def build_service(tg: TrainerGroup) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(tg, server_name(tg)),
        "spec": {
            "type": "ClusterIP",
            "selector": server_selector(tg),
            "ports": [
                {
                    "name": PORT_NAME,
                    "protocol": "TCP",
                    "port": port(tg),
                    "targetPort": PORT_NAME,
                }
            ],
        },
    }


def build_networkpolicy(tg: TrainerGroup) -> dict[str, Any]:
    """Only the group's labelled clients reach the API; the group's Ray pods reach the
    server's Ray ports (it is a driver). Everything else gets no TCP."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(tg, server_name(tg)),
        "spec": {
            "podSelector": {"matchLabels": server_selector(tg)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {CLIENT_LABEL: tg.name}}},
                        # the namespace's Tinker gateway (tg_operator.gateway; a cluster-wide
                        # one gets a policy of its own in the group's namespace)
                        {"podSelector": {"matchLabels": {GATEWAY_LABEL: "true"}}},
                    ],
                    "ports": [{"protocol": "TCP", "port": port(tg)}],
                },
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": {names.RAY_CLUSTER_LABEL: names.cluster_name(tg)}
                            }
                        }
                    ]
                },
            ],
        },
    }


# -- the server ------------------------------------------------------------------------------
# A Ray driver must run on a node of its cluster (tgruntime.controller.connect refuses it), so
# the server pod first joins the group's cluster as a node that runs nothing but the server, as
# the example client Job does: wait until the group is Ready, `ray start`, then exec the server
# ("$@", the list below). The raylet's object store is small: the server moves token batches.
SERVER_SCRIPT = (
    'addr="$("$1" -m tgruntime.entrypoints.client_job wait --trainergroup "$TG_NAME" '
    '--k8s-namespace "$TG_K8S_NAMESPACE" --print-address)"\n'
    'ray start --address="$addr" --num-cpus=0 --num-gpus=0 '
    "--object-store-memory=300000000 --disable-usage-stats\n"
    'exec "$@"\n'
)


def server_command(tg: TrainerGroup, *, python: str) -> list[str]:
    """``bash -ceu SERVER_SCRIPT tinker-server <python -m tgruntime.service ...>``."""
    return ["bash", "-ceu", SERVER_SCRIPT, "tinker-server", *server_args(tg, python=python)]


def server_args(tg: TrainerGroup, *, python: str) -> list[str]:
    """The server's own command line (what the script execs once the pod is a Ray node)."""
    return [
        python,
        "-m",
        SERVICE_MODULE,
        "--trainergroup",
        tg.name,
        "--k8s-namespace",
        tg.namespace,
        "--host",
        "0.0.0.0",
        "--port",
        str(port(tg)),
        "--keys-dir",
        KEYS_DIR,
        *access_args(tg),
    ]


def access_args(tg: TrainerGroup) -> list[str]:
    """``--admin-principals`` and ``--tls-cert``/``--tls-key`` from ``spec.api``."""
    api = tg.spec.api
    out: list[str] = []
    if api.admin_principals:
        out += ["--admin-principals", ",".join(api.admin_principals)]
    if api.tls is not None:
        out += ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
    return out


def _healthy(tg: TrainerGroup, *, python: str) -> str:
    """The startup probe's check: healthz answers 200 (with TLS through the runtime's Python,
    the certificate not verified: it is the pod's own loopback). With TLS one Python process
    polls until the answer comes: a new interpreter every 3 s (about 0.5 CPU s each, with ssl)
    took most of a 250m CPU limit, and the pod's own `ray start` then missed Ray's fixed 30 s
    raylet registration wait, again at every restart (the kind suite, 2026-12-06 08:46)."""
    if tg.spec.api.tls is None:
        return probes.http_200(port=port(tg), path="/healthz")
    code = (
        "import ssl,time,urllib.request as u;c=ssl.create_default_context();"
        "c.check_hostname=False;c.verify_mode=ssl.CERT_NONE;"
        f"U='https://127.0.0.1:{port(tg)}/healthz';"
        "exec('while 1:\\n try:\\n  u.urlopen(U,context=c,timeout=5);break"
        "\\n except Exception:time.sleep(3)')"
    )
    return f'"{python}" -c "{code}" >/dev/null 2>&1'


def _pod_spec(tg: TrainerGroup, *, python: str) -> dict[str, Any]:
    server = tg.spec.api.server
    # CPU requested, not capped: the start imports torch and Ray and runs a raylet, which a
    # limit at a small request throttled past Ray's fixed 30 s registration (kind, 250m: the
    # teacher group's server took minutes to serve); memory requested and capped
    requests = {"cpu": server.cpu, "memory": server.memory}
    limits = {"memory": server.memory}
    env: list[dict[str, Any]] = [
        {"name": KEYS_DIR_ENV, "value": KEYS_DIR},
        {"name": "TG_TINKER_PORT", "value": str(port(tg))},
        {"name": "TG_NAME", "value": tg.name},
        {"name": "TG_K8S_NAMESPACE", "value": tg.namespace},
        *ray_token.token_env(tg),
        *pods.hub_token_env(tg),
    ]
    tls = tg.spec.api.tls
    mounts = [
        {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True},
        *([{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if tls else []),
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        *platform.checkpoint_mount(tg),
    ]
    volumes = [
        # 0444: the files are root's and the runtime image runs as uid 1000 (only this pod
        # mounts the Secret; 0440 would need an fsGroup on pods without the checkpoint claim)
        {"name": "keys", "secret": {"secretName": keys_secret_name(tg), "defaultMode": 0o444}},
        *([_tls_volume(tls.secret_name)] if tls else []),
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": pods.half(server.memory)}},
        *platform.checkpoint_volume(tg),
    ]
    container = {
        "name": "tinker",
        "image": tg.spec.image,
        "command": server_command(tg, python=python),
        "env": env,
        "ports": [{"name": PORT_NAME, "containerPort": port(tg), "protocol": "TCP"}],
        "readinessProbe": {
            "httpGet": _http_get(tg),
            "periodSeconds": 5,
            "timeoutSeconds": 5,  # healthz reads the group's record from Ray (slow under load)
            "failureThreshold": 3,
        },
        # Until the server first answers 200 (the pod waited for the group, joined its Ray
        # cluster and attached), only this probe runs: the start may take minutes on a small
        # CPU share, and a liveness probe running then restarts a server that only waits. It
        # waits in one exec rather than polling, so a normal start posts no Unhealthy event.
        "startupProbe": probes.startup_wait(
            _healthy(tg, python=python),
            limit_s=STARTUP_LIMIT_S,
            every_s=STARTUP_PERIOD_S,
        ),
        # Then: restart a server whose group was re-created (healthz 503 "stale", 2 min).
        "livenessProbe": {
            "httpGet": _http_get(tg),
            "periodSeconds": 20,
            "timeoutSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
        "securityContext": pods.container_security(),
    }
    rc = tg.spec.ray_cluster
    spec: dict[str, Any] = {
        "serviceAccountName": server_name(tg),
        "containers": [container],
        "volumes": volumes,
        "securityContext": pods.pod_security(
            rc.pod_security if rc is not None else None,
            mounts_claim=bool(platform.checkpoint_volume(tg)),
        ),
    }
    if server.node_selector:
        spec["nodeSelector"] = dict(server.node_selector)
    if server.tolerations:
        spec["tolerations"] = [dict(t) for t in server.tolerations]
    if rc is not None and rc.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in rc.image_pull_secrets]
    if rc is not None and rc.priority_class_name:
        spec["priorityClassName"] = rc.priority_class_name
    return spec


def _http_get(tg: TrainerGroup) -> dict[str, Any]:
    """The kubelet's healthz probe (HTTPS with spec.api.tls: the kubelet skips verification)."""
    out: dict[str, Any] = {"path": "/healthz", "port": PORT_NAME}
    if tg.spec.api.tls is not None:
        out["scheme"] = "HTTPS"
    return out


def _tls_volume(secret: str) -> dict[str, Any]:
    # 0444, as the keys: the runtime image runs as uid 1000 and only this pod mounts it
    items = [{"key": k, "path": k} for k in ("tls.crt", "tls.key")]
    return {"name": "tls", "secret": {"secretName": secret, "defaultMode": 0o444, "items": items}}


def build_deployment(tg: TrainerGroup, *, python: str) -> dict[str, Any]:
    """The server's Deployment: one replica, replaced (never two servers for one group)."""
    server = tg.spec.api.server
    pod_labels = {
        **server.pod_labels,
        **names.labels(tg),
        SERVER_LABEL: tg.name,
        CLIENT_LABEL: tg.name,  # the group's Ray NetworkPolicy admits the server (a driver)
    }
    pod_spec = _pod_spec(tg, python=python)
    meta = _metadata(tg, server_name(tg))
    meta["annotations"] = {HASH_ANNOTATION: spec_hash(pod_spec)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": server.replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": server_selector(tg)},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": dict(server.pod_annotations)},
                "spec": pod_spec,
            },
        },
    }


def spec_hash(pod_spec: Mapping[str, Any]) -> str:
    raw = json.dumps(pod_spec, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


# -- what the watch sees ---------------------------------------------------------------------
def outdated(tg: TrainerGroup, deployment: Mapping[str, Any] | None, *, python: str) -> bool:
    """Whether the Deployment's pod template was built from another spec than ``tg``'s (its
    hash annotation differs): e.g. ``rayCluster.storage`` added, so the server must mount the
    claim its state lives on. A Deployment being deleted is not outdated (it goes anyway)."""
    if deployment is None:
        return False
    meta = deployment.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return False
    have = (meta.get("annotations") or {}).get(HASH_ANNOTATION)
    want = build_deployment(tg, python=python)["metadata"]["annotations"][HASH_ANNOTATION]
    return bool(have != want)


def available(deployment: Mapping[str, Any] | None) -> bool:
    """Whether the server's Deployment has an available pod (Available=True)."""
    if deployment is None or (deployment.get("metadata") or {}).get("deletionTimestamp"):
        return False
    status = deployment.get("status") or {}
    replicas = status.get("availableReplicas")
    ready = type(replicas) is int and replicas > 0
    for cond in status.get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == "Available":
            return cond.get("status") == "True" and ready
    return ready


def api_url(tg: TrainerGroup, deployment: Mapping[str, Any] | None) -> str:
    """``status.apiURL``: the base URL once the server is available, else empty."""
    return base_url(tg) if wanted(tg) and available(deployment) else ""


def deployment_entry(*, namespace: str, body: Mapping[str, Any]) -> dict[Any, Any]:
    """What the Deployment index keeps: (namespace, group) -> name, labels, annotations,
    deletion mark and the availability status."""
    meta = body.get("metadata") or {}
    labels = dict(meta.get("labels") or {})
    group = labels.get(SERVER_LABEL)
    if not group:
        return {}
    status = body.get("status") or {}
    slim = {
        "metadata": {
            "name": meta.get("name"),
            "labels": labels,
            "annotations": dict(meta.get("annotations") or {}),
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "status": {
            "availableReplicas": status.get("availableReplicas") or 0,
            "conditions": list(status.get("conditions") or []),
        },
    }
    return {(namespace, group): slim}


def objects(tg: TrainerGroup, *, python: str) -> tuple[dict[str, Any], ...]:
    """What to create besides the keys Secret (whose key is drawn when it is created), in
    order; the Deployment last (its presence marks the set)."""
    return (
        build_service_account(tg),
        build_role(tg),
        build_role_binding(tg),
        build_service(tg),
        build_networkpolicy(tg),
        build_deployment(tg, python=python),
    )
