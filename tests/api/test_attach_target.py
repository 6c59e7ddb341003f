"""Where a client attaches to a Ready TrainerGroup (tgapi.kube_view.attach_target, pure)."""

from __future__ import annotations

import dataclasses

import pytest

from tgapi.kube_view import AttachTarget, attach_target
from tgapi.status import parse_status

READY = {
    "phase": "Ready",
    "rayAddress": "tiny-head-svc.team-a.svc:6379",
    "rayNamespace": "tg-team-a-tiny",
    "groupName": "tiny-g2",
    "workerNames": ["tiny-g2-Trainer_0:0", "tiny-g2-Trainer_0:1"],
}


def test_the_status_says_where() -> None:
    assert attach_target(parse_status(READY), name="tiny") == AttachTarget(
        ray_address="tiny-head-svc.team-a.svc:6379",
        ray_namespace="tg-team-a-tiny",
        group_name="tiny-g2",
        worker_names=("tiny-g2-Trainer_0:0", "tiny-g2-Trainer_0:1"),
    )


def test_a_given_address_wins_over_the_status() -> None:
    where = attach_target(parse_status(READY), name="tiny", address="10.0.0.7:6379")
    assert where.ray_address == "10.0.0.7:6379"
    assert (where.ray_namespace, where.group_name) == ("tg-team-a-tiny", "tiny-g2")


def test_empty_fields_fall_back() -> None:
    # no groupName: the TrainerGroup's own name; no rayAddress and none given: None (the
    # caller's default applies: RAY_ADDRESS, else auto); an empty override is no override.
    status = parse_status({**READY, "groupName": "", "rayAddress": ""})
    where = attach_target(status, name="tiny", address="")
    assert where.group_name == "tiny" and where.ray_address is None
    assert attach_target(status, name="tiny", address="h:1").ray_address == "h:1"


def test_the_target_is_frozen() -> None:
    where = attach_target(parse_status(READY), name="tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        where.ray_namespace = "other"  # type: ignore[misc]
