"""Shared builders for the operator's tests: TrainerGroup bodies, pods, actors."""

from __future__ import annotations

import copy
from typing import Any

from tests.specs import tiny_spec
from tgapi import TrainerGroup, parse_resource

BASE_SPEC: dict[str, Any] = tiny_spec()


def body(
    name: str = "demo",
    namespace: str = "team-a",
    *,
    spec: dict[str, Any] | None = None,
    uid: str = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0",
    generation: int = 1,
    **spec_overrides: Any,
) -> dict[str, Any]:
    s = copy.deepcopy(BASE_SPEC if spec is None else spec)
    s.update(spec_overrides)
    return {
        "apiVersion": "trainergroup.io/v1alpha1",
        "kind": "TrainerGroup",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation},
        "spec": s,
    }


def trainergroup(**kwargs: Any) -> TrainerGroup:
    return parse_resource(body(**kwargs))


def pod(
    name: str,
    *,
    node_type: str,
    ready: bool = True,
    unschedulable: str | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = []
    if unschedulable is not None:
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
            }
        )
    else:
        conditions.append({"type": "PodScheduled", "status": "True"})
        conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    meta: dict[str, Any] = {"name": name, "labels": {"ray.io/node-type": node_type}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": conditions}}


def raycluster_obj(
    *, replicas: int = 1, provisioned: bool | None = True, state: str | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if provisioned is not None:
        status["conditions"] = [
            {
                "type": "RayClusterProvisioned",
                "status": "True" if provisioned else "False",
                "reason": "AllPodRunningAndReadyFirstTime"
                if provisioned
                else "RayClusterPodsProvisioning",
                "message": "" if provisioned else "pods are provisioning",
            }
        ]
    if state is not None:
        status["state"] = state
    return {
        "metadata": {"name": "demo"},
        "spec": {"workerGroupSpecs": [{"groupName": "workers", "replicas": replicas}]},
        "status": status,
    }
