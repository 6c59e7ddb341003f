"""The rules and defaults of issue 36 that say what spans nodes: checkpoints without a shared
volume, tensor-parallel groups across nodes, and the placement strategy of GPU groups."""

from __future__ import annotations

from typing import Any

import pytest

import tgapi
from tgapi import SpecErrors, parse_spec

SMALL_MODEL = {"numAttentionHeads": 8, "hiddenSize": 64, "vocabSize": 64, "ffnHiddenSize": 128,
               "numLayers": 2, "maxSequenceLength": 128}


def _spec(*, ppn: list[int], tensor: int = 1, context: int = 1, use_gpu: Any = "auto",
          gpus: int = 8, replicas: int = 4, checkpoint_dir: str = "",
          storage: bool = False, cluster: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "workers": {"processesPerNode": ppn, "useGpu": use_gpu},
        "parallelism": {"tensor": tensor, "context": context},
        "model": SMALL_MODEL,
        "training": {"batchSize": 64, "sequenceLength": 128, "checkpointDir": checkpoint_dir},
    }
    if cluster:
        spec["rayCluster"] = {"workers": {"replicas": replicas, "gpusPerWorker": gpus,
                                          "memory": "1Ti"}}
        if storage:
            spec["rayCluster"]["storage"] = {"claimName": "ckpt", "mountPath": "/ckpt"}
    else:
        spec["rayClusterRef"] = {"name": "shared"}
    return spec


def _errors(spec: dict[str, Any], *, local: bool = False) -> dict[str, tgapi.SpecError]:
    try:
        parse_spec(spec, local=local)
    except SpecErrors as e:
        return {err.field: err for err in e.errors}
    return {}


# -- checkpoint-needs-storage --------------------------------------------------------------
def test_checkpoints_without_storage_are_refused_for_a_group_on_several_nodes() -> None:
    errors = _errors(_spec(ppn=[4, 4], checkpoint_dir="/ckpt/run"))
    err = errors["spec.training.checkpointDir"]
    assert "without rayCluster.storage for a group on 2 nodes" in err.problem
    assert "resume from different steps" in err.problem
    assert "add rayCluster.storage" in err.fix and "ReadWriteMany" in err.fix


@pytest.mark.parametrize(
    "spec",
    [
        _spec(ppn=[4], checkpoint_dir="/ckpt/run"),  # one node: its disk is the only one
        _spec(ppn=[4, 4], checkpoint_dir="/ckpt/run", storage=True),
        _spec(ppn=[4, 4]),  # no checkpoints
        _spec(ppn=[4, 4], checkpoint_dir="/ckpt/run", cluster=False),  # its volumes: unknown
    ],
)
def test_checkpoints_on_one_node_on_storage_or_none_are_accepted(spec: dict[str, Any]) -> None:
    assert "spec.training.checkpointDir" not in _errors(spec)


def test_local_mode_does_not_need_storage() -> None:
    spec = _spec(ppn=[1, 1], checkpoint_dir="/tmp/ckpt", use_gpu=False, cluster=False)
    del spec["rayClusterRef"]
    assert _errors(spec, local=True) == {}


# -- tensor-groups-in-node -------------------------------------------------------------------
def test_a_tensor_group_across_nodes_is_refused_for_gpu_workers() -> None:
    errors = _errors(_spec(ppn=[4, 4], tensor=8, gpus=4))
    err = errors["spec.parallelism.tensor"]
    assert err.problem.startswith("tensor x context = 8 x 1 = 8 does not divide the 4 GPU")
    assert "multiple of 8" in err.fix


def test_tensor_times_context_must_fit_a_node() -> None:
    errors = _errors(_spec(ppn=[4, 4], tensor=2, context=4, gpus=4))
    assert "2 x 4 = 8" in errors["spec.parallelism.tensor"].problem
    assert "spec.parallelism.tensor" not in _errors(_spec(ppn=[8, 8], tensor=2, context=4))


def test_every_node_counts_not_only_the_first() -> None:
    errors = _errors(_spec(ppn=[4, 2], tensor=2, gpus=4, replicas=2) | {
        "training": {"batchSize": 3, "sequenceLength": 128}})
    assert "spec.parallelism.tensor" not in errors  # 4 and 2 are both multiples of 2
    errors = _errors(_spec(ppn=[4, 4, 2, 6], tensor=4, gpus=8))
    assert "the 2 GPU processes" in errors["spec.parallelism.tensor"].problem


@pytest.mark.parametrize(
    "spec",
    [
        _spec(ppn=[8, 8], tensor=8),
        _spec(ppn=[4, 4], tensor=4, gpus=4),
        _spec(ppn=[4, 4], tensor=8, gpus=0, use_gpu="auto"),  # auto on a CPU cluster: gloo
        _spec(ppn=[4, 4], tensor=8, use_gpu=False),  # CPU workers may span nodes (gloo)
    ],
)
def test_tensor_groups_inside_a_node_or_on_cpu_are_accepted(spec: dict[str, Any]) -> None:
    assert "spec.parallelism.tensor" not in _errors(spec)


def test_the_rule_holds_on_a_referenced_cluster_when_use_gpu_is_true() -> None:
    errors = _errors(_spec(ppn=[4, 4], tensor=8, use_gpu=True, cluster=False))
    assert "spec.parallelism.tensor" in errors


# -- placementStrategy: auto -----------------------------------------------------------------
def test_gpu_workers_default_to_strict_pack_and_cpu_workers_to_pack() -> None:
    gpu = parse_spec(_spec(ppn=[8], tensor=8, use_gpu=True))
    assert gpu.workers.placement == "auto"
    assert gpu.workers.placement_strategy == "STRICT_PACK"
    cpu = parse_spec(_spec(ppn=[8], tensor=8, use_gpu=False))
    assert cpu.workers.placement_strategy == "PACK"


def test_auto_use_gpu_resolves_the_placement_with_it() -> None:
    spec = parse_spec(_spec(ppn=[8], tensor=8, use_gpu="auto"))
    assert spec.with_gpu_resolved(8).workers.placement_strategy == "STRICT_PACK"
    assert spec.with_gpu_resolved(0).workers.placement_strategy == "PACK"


def test_an_explicit_strategy_is_kept() -> None:
    spec = _spec(ppn=[8], tensor=8, use_gpu=True)
    spec["workers"]["placementStrategy"] = "PACK"
    assert parse_spec(spec).workers.placement_strategy == "PACK"
    assert tgapi.to_wire(parse_spec(spec))["workers"]["placementStrategy"] == "PACK"


def test_the_wire_form_keeps_auto() -> None:
    assert tgapi.to_wire(parse_spec(_spec(ppn=[8], use_gpu=True)))["workers"][
        "placementStrategy"
    ] == "auto"


# -- the CPU pods' memory check with the default memory ----------------------------------
def test_the_size_check_reads_the_default_memory_of_cpu_pods() -> None:
    big = {"numAttentionHeads": 32, "hiddenSize": 4096, "vocabSize": 32000,
           "ffnHiddenSize": 11008, "numLayers": 32, "maxSequenceLength": 128}
    spec = _spec(ppn=[1], use_gpu=False, gpus=0, replicas=1)
    spec["model"] = big
    spec["training"]["batchSize"] = 1
    del spec["rayCluster"]["workers"]["memory"]
    err = _errors(spec)["spec.rayCluster.workers.memory"]
    assert err.problem.startswith("the default 32Gi (32Gi + 32Gi per GPU) is too small")
    spec["rayCluster"]["workers"]["gpusPerWorker"] = 8  # 288Gi: CPU workers on GPU pods
    assert "spec.rayCluster.workers.memory" not in _errors(spec)
