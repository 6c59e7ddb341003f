"""The waiter's decisions on plain TrainerGroup objects (tgapi.kube_view.ready; no Kubernetes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tgapi import TimeoutsSpec
from tgapi.kube_view import is_failed, is_ready, ready_deadline

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "trainergroup.yaml"


def _obj(generation: int, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "t", "generation": generation}, "status": status}


def test_ready_needs_the_current_generation_and_worker_names() -> None:
    assert is_ready(_obj(2, phase="Ready", observedGeneration=2, workerNames=["w0"]))
    assert not is_ready(_obj(2, phase="Ready", observedGeneration=1, workerNames=["w0"]))
    assert not is_ready(_obj(1, phase="Ready", observedGeneration=1, workerNames=[]))
    assert not is_ready(_obj(1))


def test_failed_counts_only_for_the_current_spec() -> None:
    assert is_failed(_obj(3, phase="Failed", observedGeneration=3, message="boom"))
    assert not is_failed(_obj(3, phase="Failed", observedGeneration=2))  # a new spec may fix it
    assert not is_failed(_obj(1, phase="Pending", observedGeneration=1))


def test_ready_deadline_is_the_specs_timeouts_else_the_defaults() -> None:
    obj = yaml.safe_load(EXAMPLE.read_text())
    obj["spec"]["timeouts"] = {"clusterReadySeconds": 30, "workersReadySeconds": 12}
    assert ready_deadline(obj) == 42
    obj["spec"]["workers"]["useGpu"] = "yes"  # invalid: the defaults apply
    assert ready_deadline(obj) == TimeoutsSpec().ready_seconds
