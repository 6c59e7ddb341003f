"""The Kubernetes permissions the operator and the client need (least privilege).

This is the list the Helm chart's ClusterRole/Role is written from, and the
integration tests run the operator with exactly these rules through a service
account token. ``python -m tg_operator.rbac`` prints them as YAML.

Cluster-wide operator (``TG_NAMESPACES`` empty): one ClusterRole with
:data:`OPERATOR_RULES` and :data:`OPERATOR_CLUSTER_RULES`. Namespaced operator: a Role with
:data:`OPERATOR_RULES` in each watched namespace, and no cluster-scoped rule (what
:data:`OPERATOR_CLUSTER_RULES` would read is then unknown, and its status message is left
out). The client (``tg-client --trainergroup``, ``tg-client wait``)
needs :data:`CLIENT_RULES` in the TrainerGroup's namespace: ``get`` and ``watch`` (the waiter in
``tgapi.kube_view`` reads the object, then watches it by name) and :data:`CLIENT_TOKEN_RULES` (get
the group's Ray token Secret, ``<name>-ray-token``). The chart's client Role is these
rules restricted by ``resourceNames`` (tests/deploy/test_chart_render.py compares them).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from tg_operator import names, queue

OPERATOR_RULES: list[dict[str, Any]] = [
    # kopf watches TrainerGroups and patches their metadata (finalizer, progress annotations).
    {
        "apiGroups": [names.GROUP],
        "resources": [names.TG_PLURAL],
        "verbs": ["get", "list", "watch", "patch"],
    },
    # The operator writes the status subresource.
    {
        "apiGroups": [names.GROUP],
        "resources": [f"{names.TG_PLURAL}/status"],
        "verbs": ["get", "patch"],
    },
    # Owner references with blockOwnerDeletion on the RayCluster need update on finalizers.
    {
        "apiGroups": [names.GROUP],
        "resources": [f"{names.TG_PLURAL}/finalizers"],
        "verbs": ["update"],
    },
    # RayClusters are watched (an index wakes the group on every change), created, deleted.
    {
        "apiGroups": [names.RAY_GROUP],
        "resources": [names.RAY_PLURAL],
        "verbs": ["get", "list", "watch", "create", "delete"],
    },
    # spec.queue: the Kueue Workload of a suspended RayCluster, for its admission message.
    {"apiGroups": [queue.WORKLOAD_GROUP], "resources": [queue.WORKLOAD_PLURAL], "verbs": ["list"]},
    # Readiness: each pod's Ready and PodScheduled (Unschedulable) conditions, watched.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    # kopf.event(): phase changes and failures.
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # The checkpoint claim (rayCluster.storage.claimName), read once before the RayCluster is
    # created: an access mode that cannot serve the pods that mount it fails the group
    # (tg_operator.claims). Read only: the operator never creates or deletes a claim.
    {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
    # Each group's Ray token Secret (tg_operator.ray_token): create only. The token is
    # derived from the operator's key, so the operator reads no Secret anywhere.
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # Each group's NetworkPolicies (tg_operator.networkpolicy, tg_operator.tinker).
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create"]},
    # The Tinker API server of each group (tg_operator.tinker): its Deployment is watched
    # (an index: the group's status.apiURL follows its availability), created once, and
    # patched when the group's spec changes what its pod needs (e.g. the checkpoint claim);
    # its Service and ServiceAccount are created once; the keys Secret is the create above.
    # The same kinds for the namespace's Tinker gateway (tg_operator.gateway; its Deployment's
    # owners are patched as groups come; its Role: get/list/watch on TrainerGroups).
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["list", "watch", "create", "patch"],
    },
    {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": ["create"]},
    # The server's Role (get/watch on its own TrainerGroup, which the operator holds itself:
    # no escalate or bind needed) and its RoleBinding.
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["create"],
    },
]

# Cluster-scoped reads: in the all-namespaces ClusterRole only (a Role cannot grant them).
OPERATOR_CLUSTER_RULES: list[dict[str, Any]] = [
    # spec.queue.priorityClass of a suspended RayCluster with no Workload: does Kueue's
    # WorkloadPriorityClass exist (Kueue makes no Workload and no event when it does not)?
    {
        "apiGroups": [queue.WORKLOAD_GROUP],
        "resources": [queue.PRIORITY_CLASS_PLURAL],
        "verbs": ["get"],
    },
]

CLIENT_RULES: list[dict[str, Any]] = [
    {"apiGroups": [names.GROUP], "resources": [names.TG_PLURAL], "verbs": ["get", "watch"]},
]
CLIENT_TOKEN_RULES: list[dict[str, Any]] = [
    # the group's Ray token (Secret <name>-ray-token, docs/security.md) and its Tinker API
    # keys (Secret <name>-tinker-keys)
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
]


def cluster_role(name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": rules,
    }


def main() -> int:
    docs = [
        cluster_role("trainergroup-operator", OPERATOR_RULES + OPERATOR_CLUSTER_RULES),
        cluster_role("trainergroup-client", CLIENT_RULES),
    ]
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
