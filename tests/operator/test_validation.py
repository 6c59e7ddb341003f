"""Bad specs: every class of mistake names the field and the fix (operator side).

The CRD's schema and CEL rules reject most of these at ``kubectl apply`` (see the
k8s tests); the operator validates again with tgapi and sets phase Failed with
this message, creating nothing.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.operator.helpers import body
from tg_operator.reconcile import format_spec_errors
from tgapi import SpecErrors, parse_resource


def _mut(path: str, value: Any) -> dict[str, Any]:
    b = copy.deepcopy(body())
    node = b["spec"]
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return b


_DELETE = object()

CASES = [
    # (mutation, field named in the message, words of the fix)
    (("parallelism.tensor", 3), "spec.parallelism", "multiple of 3"),
    (("model.numAttentionHeads", 3), "spec.model.hiddenSize", "multiple of the head count"),
    (("parallelism.pipeline", 3), "spec.model.numLayers", "multiple of parallelism.pipeline"),
    (("training.sequenceLength", 128), "spec.training.sequenceLength", "maxSequenceLength"),
    (("training.batchSize", 3), "spec.training.batchSize", "multiple of 2"),
    (("parallelism.expert", 2), "spec.parallelism.expert", "set parallelism.expert to 1"),
    (("restartPolicy", "Always"), "spec.restartPolicy", "OnFailure"),
    (("workers.processesPerNode", [0]), "spec.workers.processesPerNode[0]", ">= 1"),
    (("workers.workerClass", "not a path"), "spec.workers.workerClass", "pattern"),
    (("workers.procesesPerNode", [1]), "spec.workers.procesesPerNode", "processesPerNode"),
    (("model.hiddenSize", "big"), "spec.model.hiddenSize", "whole number"),
    (("rayCluster", _DELETE), "spec.rayCluster", "exactly one of rayCluster and rayClusterRef"),
    (("rayClusterRef", {"name": "other"}), "spec.rayCluster", "exactly one"),
    (("rayCluster.workers.cpu", "lots"), "spec.rayCluster.workers.cpu", "pattern"),
]


@pytest.mark.parametrize(
    ("mutation", "field", "fix"), CASES, ids=[c[1] + ":" + str(c[0][1]) for c in CASES]
)
def test_each_mistake_is_named_with_its_fix(
    mutation: tuple[str, Any], field: str, fix: str
) -> None:
    with pytest.raises(SpecErrors) as info:
        parse_resource(_mut(*mutation))
    message = format_spec_errors(info.value)
    assert message.startswith("invalid spec: ")
    assert field in message, message
    assert fix in message, message


def test_gpu_workers_need_gpu_pods() -> None:
    b = _mut("workers.useGpu", True)
    b["spec"]["rayCluster"]["workers"]["gpusPerWorker"] = 0
    with pytest.raises(SpecErrors) as info:
        parse_resource(b)
    assert "spec.rayCluster.workers.gpusPerWorker" in format_spec_errors(info.value)


def test_cpu_workers_on_gpu_pods_are_allowed() -> None:
    # The k8s tests run CPU (gloo) workers in the local Ray while the RayCluster's pods
    # ask for GPUs, so that they land on the fake GPU node.
    tg = parse_resource(body())
    assert tg.spec.workers.use_gpu is False
    assert tg.spec.ray_cluster is not None and tg.spec.ray_cluster.workers.gpus_per_worker == 2


def test_several_mistakes_are_reported_together() -> None:
    b = _mut("model.hiddenSize", "big")
    b["spec"]["restartPolicy"] = "Sometimes"
    with pytest.raises(SpecErrors) as info:
        parse_resource(b)
    assert len(info.value.errors) >= 2
