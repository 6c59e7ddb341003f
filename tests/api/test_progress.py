"""tgapi.progress: the group record's ``training`` object on the wire (pure)."""

from __future__ import annotations

import json
import math

import pytest

from tgapi.progress import TrainingProgress, describe_age


def test_wire_round_trip_is_camel_case_and_lossless() -> None:
    p = TrainingProgress(
        step=7, loss=2.5, grad_norm=0.75, tokens_per_s=1234.5, last_step_at=1.7e9, runs=1
    )
    wire = p.to_wire()
    assert wire == {
        "step": 7,
        "loss": 2.5,
        "gradNorm": 0.75,
        "tokensPerSecond": 1234.5,
        "lastStepAt": 1.7e9,
        "runs": 1,
    }
    assert TrainingProgress.from_wire(json.loads(json.dumps(wire))) == p


def test_non_finite_values_are_null_on_the_wire() -> None:
    p = TrainingProgress(step=1, loss=math.nan, grad_norm=math.inf, tokens_per_s=None)
    wire = p.to_wire()
    assert wire["loss"] is None and wire["gradNorm"] is None and wire["tokensPerSecond"] is None
    json.dumps(wire, allow_nan=False)  # strict JSON (the operator is to read it)
    back = TrainingProgress.from_wire(wire)
    assert (back.loss, back.grad_norm, back.tokens_per_s) == (None, None, None)


def test_from_wire_defaults_ignores_extra_keys_and_needs_step() -> None:
    p = TrainingProgress.from_wire({"step": 3, "newerKey": True})
    assert p == TrainingProgress(step=3)
    assert p.runs == 1 and p.last_step_at == 0.0
    with pytest.raises(ValueError, match="'step' is missing"):
        TrainingProgress.from_wire({"loss": 1.0})
    with pytest.raises(ValueError, match="training progress"):
        TrainingProgress.from_wire({"step": "x"})


def test_age() -> None:
    p = TrainingProgress(step=1, last_step_at=100.0)
    assert p.age_s(112.5) == 12.5
    assert p.age_s(90.0) == 0.0  # a reader's clock behind the writer's
    assert describe_age(12.9) == "12 s ago"
    assert describe_age(-3) == "0 s ago"
    assert describe_age(119) == "119 s ago"
    assert describe_age(300) == "5 min ago"
    assert describe_age(3 * 3600) == "3 h ago"
    assert describe_age(3 * 86400) == "3 d ago"


def test_a_lora_groups_runs_travel_to_the_status() -> None:
    """The worker lists a LoRA group's runs (id, steps, last activity); the operator's
    status.training.runList shows them with RFC 3339 times."""
    from tg_operator.training import training_status
    from tgapi.progress import RunProgress

    p = TrainingProgress(
        step=7,
        runs=2,
        run_list=(
            RunProgress(run_id="s:train:1", steps=7, last_active=1800000000.0),
            RunProgress(run_id="s:train:0", steps=3, last_active=1799999990.5),
        ),
    )
    back = TrainingProgress.from_wire(json.loads(json.dumps(p.to_wire())))
    assert back == p
    status = training_status(back)
    assert [(r.id, r.steps) for r in status.run_list] == [("s:train:1", 7), ("s:train:0", 3)]
    assert status.run_list[0].last_activity_time.startswith("2027-01-15T08:00:00")
    with pytest.raises(ValueError, match="training progress"):
        TrainingProgress.from_wire({"step": 1, "runList": [{"steps": 1}]})  # no id
