"""The platform fields of spec.rayCluster (storage, identity, labels): parsed, checked, and
the checkpoint directory kept on the checkpoint volume (rule checkpoint-on-storage)."""

from __future__ import annotations

from typing import Any

import pytest

import tgapi

STORAGE = "spec.rayCluster.storage"
CLUSTER: dict[str, Any] = {"workers": {"replicas": 1, "gpusPerWorker": 0}}


def _spec(*, checkpoint_dir: str = "", **cluster: Any) -> dict[str, Any]:
    return {
        "rayCluster": {**CLUSTER, **cluster},
        "workers": {"useGpu": False},
        "training": {"checkpointDir": checkpoint_dir},
    }


def _errors(spec: dict[str, Any], *, local: bool = False) -> list[str]:
    with pytest.raises(tgapi.SpecErrors) as info:
        tgapi.parse_spec(spec, local=local)
    return [str(e) for e in info.value.errors]


@pytest.mark.parametrize("directory", ["/ckpt", "/ckpt/demo", "/ckpt/a/b", ""])
def test_checkpoint_dir_on_the_volume_is_accepted(directory: str) -> None:
    spec = tgapi.parse_spec(
        _spec(checkpoint_dir=directory, storage={"claimName": "ckpt", "mountPath": "/ckpt"})
    )
    assert spec.ray_cluster is not None and spec.ray_cluster.storage is not None
    assert spec.ray_cluster.storage.claim_name == "ckpt"


@pytest.mark.parametrize("directory", ["/ckpt-old", "/tmp/ckpt", "/ckpt/../etc", "ckpt/demo"])
def test_checkpoint_dir_off_the_volume_names_the_field_and_the_fix(directory: str) -> None:
    (message,) = _errors(
        _spec(checkpoint_dir=directory, storage={"claimName": "ckpt", "mountPath": "/ckpt"})
    )
    assert message.startswith("spec.training.checkpointDir: is not rayCluster.storage.mountPath")
    assert "Fix: set training.checkpointDir to rayCluster.storage.mountPath" in message


def test_default_mount_path_and_no_storage_leave_checkpoint_dir_alone() -> None:
    spec = tgapi.parse_spec(_spec(checkpoint_dir="/checkpoints/x", storage={"claimName": "c"}))
    assert spec.ray_cluster is not None and spec.ray_cluster.storage is not None
    assert spec.ray_cluster.storage.mount_path == "/checkpoints"
    tgapi.parse_spec(_spec(checkpoint_dir="/anywhere"))  # no storage: no rule


def test_local_mode_skips_the_storage_rule() -> None:
    tgapi.parse_spec(
        _spec(checkpoint_dir="/tmp/x", storage={"claimName": "c", "mountPath": "/ckpt"}),
        local=True,
    )


@pytest.mark.parametrize(
    ("cluster", "field"),
    [
        ({"storage": {"mountPath": "/ckpt"}}, "spec.rayCluster.storage.claimName: is required"),
        ({"storage": {"claimName": "Bad_Name"}}, "spec.rayCluster.storage.claimName: 'Bad_Name'"),
        ({"storage": {"claimName": "c", "mountPath": "/ckpt/"}}, f"{STORAGE}.mountPath"),
        ({"storage": {"claimName": "c", "mountPath": "ckpt"}}, f"{STORAGE}.mountPath"),
        ({"imagePullSecrets": ["ok", "Not OK"]}, "spec.rayCluster.imagePullSecrets[1]"),
        ({"serviceAccountName": "UPPER"}, "spec.rayCluster.serviceAccountName"),
        ({"priorityClassName": "a b"}, "spec.rayCluster.priorityClassName"),
        ({"podLabels": {"a": 1}}, "spec.rayCluster.podLabels.a: expected a string value"),
        ({"head": {"nodeSelector": {"pool": True}}}, "spec.rayCluster.head.nodeSelector.pool"),
    ],
)
def test_bad_platform_fields_are_refused_by_name(cluster: dict[str, Any], field: str) -> None:
    (message,) = _errors(_spec(**cluster))
    assert message.startswith(field), message


def test_platform_fields_round_trip_in_wire_form() -> None:
    raw = _spec(
        checkpoint_dir="/ckpt/g",
        storage={"claimName": "ckpt", "mountPath": "/ckpt"},
        serviceAccountName="trainer",
        imagePullSecrets=["regcred"],
        priorityClassName="high",
        labels={"team": "llm"},
        annotations={"a": "b"},
        podLabels={"c": "d"},
        podAnnotations={"e": "f"},
        head={"nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "k", "operator": "Exists"}]},
    )
    wire = tgapi.to_wire(tgapi.parse_spec(raw))
    for key, value in raw["rayCluster"].items():
        if key in ("storage", "head", "workers"):  # defaults filled in beside what was set
            assert wire["rayCluster"][key] == {**wire["rayCluster"][key], **value}
        else:
            assert wire["rayCluster"][key] == value
