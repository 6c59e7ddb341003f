"""Which spec changes re-create the group, the cluster, or nothing."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from tests.operator.helpers import body
from tg_operator.spec_change import SpecChange, _digest, classify, cluster_hash, group_hash
from tgapi import TrainerGroupStatus, parse_resource, to_wire


def _running(b: dict[str, Any]) -> TrainerGroupStatus:
    tg = parse_resource(b)
    return TrainerGroupStatus(
        group_generation=0,
        submission_id="tg-team-a-demo-0b1c2d3e-g0",
        spec_hash=group_hash(tg.spec),
        cluster_hash=cluster_hash(tg.spec),
    )


def _changed(mutate: Any) -> SpecChange:
    old = body()
    status = _running(old)
    new = copy.deepcopy(old)
    mutate(new)
    return classify(status, parse_resource(new).spec)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda b: b["metadata"].setdefault("labels", {}).update(team="x"), SpecChange.NONE),
        (lambda b: b["metadata"].setdefault("annotations", {}).update(a="b"), SpecChange.NONE),
        (lambda b: b["spec"].update(restartPolicy="Never"), SpecChange.NONE),
        (lambda b: b["spec"].update(timeouts={"clusterReadySeconds": 5}), SpecChange.NONE),
        (
            lambda b: b["spec"].setdefault("training", {}).update(stallSeconds=60),
            SpecChange.NONE,
        ),
        (lambda b: b["spec"]["model"].update(numLayers=4), SpecChange.GROUP),
        (lambda b: b["spec"].update(optimizer={"lr": 1e-3}), SpecChange.GROUP),
        (lambda b: b["spec"]["workers"].update(processesPerNode=[1]), SpecChange.GROUP),
        (lambda b: b["spec"]["training"].update(batchSize=8), SpecChange.GROUP),
        (lambda b: b["spec"].update(image="other:1"), SpecChange.CLUSTER),
        (lambda b: b["spec"]["rayCluster"]["workers"].update(replicas=2), SpecChange.CLUSTER),
        (
            lambda b: (b["spec"].pop("rayCluster"), b["spec"].update(rayClusterRef={"name": "s"})),
            SpecChange.CLUSTER,
        ),
    ],
)
def test_classification(mutate: Any, expected: SpecChange) -> None:
    assert _changed(mutate) is expected


def test_no_group_yet_means_nothing_to_recreate() -> None:
    tg = parse_resource(body())
    assert classify(TrainerGroupStatus(), tg.spec) is SpecChange.NONE
    # after a teardown the bookkeeping is cleared until the next submission
    st = dataclasses.replace(_running(body()), submission_id="", spec_hash="", cluster_hash="")
    assert classify(st, parse_resource(body(image="x:2")).spec) is SpecChange.NONE


def test_hashes_ignore_defaults_spelling() -> None:
    a = parse_resource(body())
    b_ = body()
    b_["spec"]["parallelism"] = {"tensor": 1, "pipeline": 1}  # explicit defaults
    assert group_hash(a.spec) == group_hash(parse_resource(b_).spec)


def test_the_group_hash_of_a_spec_before_stall_seconds_existed_is_unchanged() -> None:
    """A group made by an operator without ``training.stallSeconds`` keeps its hash after the
    upgrade (otherwise every running group would be re-created)."""
    spec = parse_resource(body()).spec
    wire = to_wire(spec.training)
    wire.pop("stallSeconds")
    wire.pop("microBatchTokens")
    wire.pop("keepCheckpoints")  # added later too (issue 38)
    wire.pop("samplerWeightsMemory")  # and issue 35's sampler-weights budget
    before = _digest(
        {
            # placementStrategy's default was PACK before auto existed
            "workers": {**to_wire(spec.workers), "placementStrategy": "PACK"},
            "parallelism": to_wire(spec.parallelism),
            "model": to_wire(spec.model),
            "optimizer": to_wire(spec.optimizer),
            "training": wire,
        }
    )
    assert group_hash(spec) == before


def test_micro_batch_tokens_is_hashed_only_when_set() -> None:
    """A group made before ``training.microBatchTokens`` existed keeps its hash; setting it
    re-creates the workers (they read it when they start)."""
    plain = parse_resource(body()).spec
    b_ = body()
    b_["spec"].setdefault("training", {})["microBatchTokens"] = 0
    assert group_hash(parse_resource(b_).spec) == group_hash(plain)
    b_["spec"]["training"]["microBatchTokens"] = 8192
    assert group_hash(parse_resource(b_).spec) != group_hash(plain)
    b_ = body()  # the sampler-weights budget: the same rule
    b_["spec"].setdefault("training", {})["samplerWeightsMemory"] = ""
    assert group_hash(parse_resource(b_).spec) == group_hash(plain)
    b_["spec"]["training"]["samplerWeightsMemory"] = "8Gi"
    assert group_hash(parse_resource(b_).spec) != group_hash(plain)


def test_the_cluster_hash_of_a_spec_before_the_pod_fields_existed_is_unchanged() -> None:
    """runtimeClassName, podSecurity and the worker pod fields of issue 36 are hashed only when
    set: an operator upgrade does not replace the RayClusters already running."""
    spec = parse_resource(body()).spec
    cluster = to_wire(spec.ray_cluster)
    for key in ("schedulerName", "runtimeClassName", "podSecurity"):
        cluster.pop(key)
    for key in ("cpuLimit", "shmSize", "capabilities", "extendedResources", "hostNetwork",
                "ncclSocketIfname", "volumes"):
        cluster["workers"].pop(key)
    before = _digest(
        {"image": spec.image, "rayVersion": spec.ray_version, "rayCluster": cluster}
    )
    assert cluster_hash(spec) == before
    b_ = body()
    b_["spec"]["rayCluster"]["runtimeClassName"] = "nvidia"
    assert cluster_hash(parse_resource(b_).spec) != before
    b_ = body()
    b_["spec"]["rayCluster"]["workers"]["hostNetwork"] = True
    assert cluster_hash(parse_resource(b_).spec) != before


def test_placement_auto_keeps_the_old_group_hash_and_an_explicit_strategy_changes_it() -> None:
    plain = parse_resource(body()).spec
    b_ = body()
    b_["spec"]["workers"]["placementStrategy"] = "PACK"
    assert group_hash(parse_resource(b_).spec) == group_hash(plain)
    b_["spec"]["workers"]["placementStrategy"] = "STRICT_PACK"
    assert group_hash(parse_resource(b_).spec) != group_hash(plain)


def test_the_default_memory_is_hashed_as_the_old_default() -> None:
    """rayCluster.workers.memory's default was 32Gi; it is empty now (32Gi + 32Gi per GPU), and
    a group that never set it keeps its cluster hash across the upgrade."""
    unset = body()
    unset["spec"]["rayCluster"]["workers"].pop("memory")
    old = body()
    old["spec"]["rayCluster"]["workers"]["memory"] = "32Gi"
    assert cluster_hash(parse_resource(unset).spec) == cluster_hash(parse_resource(old).spec)


def test_keep_checkpoints_is_hashed_only_when_set() -> None:
    """``training.keepCheckpoints`` (issue 38): the default keeps the hash of a group made
    before it existed; a set value re-creates the workers (their engine prunes by it)."""
    plain = parse_resource(body()).spec
    b_ = body()
    b_["spec"].setdefault("training", {})["keepCheckpoints"] = 0
    assert group_hash(parse_resource(b_).spec) == group_hash(plain)
    b_["spec"]["training"]["keepCheckpoints"] = 3
    assert group_hash(parse_resource(b_).spec) != group_hash(plain)
