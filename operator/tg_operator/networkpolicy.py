"""The NetworkPolicy that fences a TrainerGroup's RayCluster.

It selects every pod of the cluster (KubeRay's ``ray.io/cluster`` label) and admits, on
ingress, only:

* the cluster's own pods (head <-> workers: GCS 6379, raylets, object managers, workers);
* the group's clients: pods in the same namespace labelled ``trainergroup.io/client=<name>``
  (a client joins the cluster as a Ray node, so it needs the same ports);
* the operator's pods (namespace and labels from its settings) on the dashboard port only.

Everything else is dropped by a CNI that enforces NetworkPolicy. Egress is not limited.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tg_operator import names, owners
from tgapi import TrainerGroup

CLIENT_LABEL = "trainergroup.io/client"
DASHBOARD_PORT = 8265
POLICY_SUFFIX = "-ray"


def policy_name(tg: TrainerGroup) -> str:
    return f"{names.cluster_name(tg)}{POLICY_SUFFIX}"


def wanted(tg: TrainerGroup) -> bool:
    rc = tg.spec.ray_cluster
    return rc is not None and rc.network_policy


def build_networkpolicy(
    tg: TrainerGroup, *, operator_namespace: str, operator_labels: Mapping[str, str]
) -> dict[str, Any]:
    """The policy for ``tg``'s own cluster; no operator rule when its namespace is unknown."""
    cluster = names.cluster_name(tg)
    ingress: list[dict[str, Any]] = [
        {"from": [{"podSelector": {"matchLabels": {names.RAY_CLUSTER_LABEL: cluster}}}]},
        {"from": [{"podSelector": {"matchLabels": {CLIENT_LABEL: tg.name}}}]},
    ]
    if operator_namespace and operator_labels:
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": operator_namespace}
                        },
                        "podSelector": {"matchLabels": dict(operator_labels)},
                    }
                ],
                "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": policy_name(tg),
            "namespace": tg.namespace,
            "labels": dict(names.labels(tg)),
            "ownerReferences": [owners.owner_reference(tg)],
        },
        "spec": {
            "podSelector": {"matchLabels": {names.RAY_CLUSTER_LABEL: cluster}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
