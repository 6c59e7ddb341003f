"""``spec.model.pretrained`` as a hub id and ``spec.model.hubTokenSecret`` in the operator's
pure builders: every container that reads the spec (head, workers, the Tinker server) gets
``HF_TOKEN`` from the Secret; the head mounts no checkpoint claim to read a hub id (it is
downloaded, tgapi.hub); both are part of the cluster hash. The download itself:
tests/api/test_hub_pretrained.py; workers loading it: tests/trainer/test_hf_group.py."""

from __future__ import annotations

import copy
from typing import Any

from tests.operator.helpers import BASE_SPEC, trainergroup
from tg_operator import platform, raycluster, spec_change, tinker
from tgapi import TrainerGroup

TOKEN_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}


def _tg(pretrained: str, **model: Any) -> TrainerGroup:
    spec = copy.deepcopy(BASE_SPEC)
    spec["model"].update(pretrained=pretrained, positionEmbedding="rope", **model)
    spec["rayCluster"]["storage"] = {"claimName": "ckpt", "mountPath": "/ckpt"}
    spec["training"]["checkpointDir"] = "/ckpt/demo"
    spec["api"] = {"tinker": True}
    return trainergroup(spec=spec)


def test_hf_token_reaches_every_container_that_reads_the_spec() -> None:
    tg = _tg("Qwen/Qwen3-0.6B", hubTokenSecret="hf")
    rc = raycluster.build_raycluster(tg, cluster_hash="h")
    containers = raycluster.ray_containers(rc)
    assert len(containers) == 2  # the head and the workers
    for c in containers:
        assert TOKEN_ENV in c["env"], c["name"]
    server = tinker.build_deployment(tg, python="python")["spec"]["template"]["spec"]
    assert TOKEN_ENV in server["containers"][0]["env"]
    plain = _tg("Qwen/Qwen3-0.6B")
    for c in raycluster.ray_containers(raycluster.build_raycluster(plain, cluster_hash="h")):
        assert all(e["name"] != "HF_TOKEN" for e in c["env"])


def test_the_head_mounts_the_claim_for_a_directory_not_for_a_hub_id() -> None:
    assert platform.head_reads_checkpoints(_tg("/ckpt/llama"))
    assert not platform.head_reads_checkpoints(_tg("Qwen/Qwen3-0.6B"))


def test_the_token_and_the_kind_of_pretrained_change_the_cluster_hash() -> None:
    hub, volume = _tg("org/m"), _tg("/ckpt/m")
    with_token = _tg("org/m", hubTokenSecret="hf")
    hashes = {spec_change.cluster_hash(t.spec) for t in (hub, volume, with_token)}
    assert len(hashes) == 3
