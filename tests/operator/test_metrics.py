"""The operator's /metrics: one ``trainergroup_*`` series per group, read from the last
status written, and :data:`EXPORTED_METRICS` naming exactly what the exposition carries."""

from __future__ import annotations

import datetime

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tg_operator import metrics
from tgapi import TrainerGroupStatus, TrainingStatus


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _key(metric: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return metric, tuple(sorted(labels.items()))


def test_a_group_has_its_series_until_it_is_forgotten() -> None:
    tracker = metrics.PhaseTracker()
    status = TrainerGroupStatus(
        phase="Ready",
        restarts=2,
        training=TrainingStatus(
            step=40, loss=1.25, tokens_per_second=512.0, last_step_time="2026-12-02T12:00:00Z"
        ),
    )
    tracker.written("uid-m1", namespace="team", name="m1", status=status)
    got = _samples()
    group = {"namespace": "team", "name": "m1"}
    assert got[_key("trainergroup_training_step", **group)] == 40
    assert got[_key("trainergroup_training_loss", **group)] == 1.25
    assert got[_key("trainergroup_training_tokens_per_second", **group)] == 512
    when = datetime.datetime(2026, 12, 2, 12, tzinfo=datetime.UTC).timestamp()
    assert got[_key("trainergroup_training_last_step_timestamp_seconds", **group)] == when
    assert got[_key("trainergroup_phase", **group, phase="Ready")] == 1
    assert got[_key("trainergroup_phase", **group, phase="Degraded")] == 0
    assert got[_key("trainergroup_restarts_total", **group)] == 2
    assert got[_key("trainergroup_queue_wait_seconds", **group)] == 0

    tracker.forget("uid-m1")
    assert not [k for k in _samples() if dict(k[1]).get("name") == "m1"]


def test_a_group_without_progress_has_no_training_series() -> None:
    tracker = metrics.PhaseTracker()
    tracker.written("uid-m2", namespace="team", name="m2", status=TrainerGroupStatus())
    names = {k[0] for k in _samples() if dict(k[1]).get("name") == "m2"}
    assert names == {
        "trainergroup_phase",
        "trainergroup_restarts_total",
        "trainergroup_queue_wait_seconds",
    }
    tracker.forget("uid-m2")


def test_exported_metrics_names_every_metric_on_the_endpoint() -> None:
    tracker = metrics.PhaseTracker()
    status = TrainerGroupStatus(
        phase="Ready",
        training=TrainingStatus(step=1, loss=1.0, tokens_per_second=1.0, last_step_time="x"),
    )
    tracker.written("uid-m3", namespace="team", name="m3", status=status)
    metrics.RECONCILES.labels(trigger="timer", result="ok")
    metrics.RECONCILE_ERRORS.labels(reason="x")
    metrics.RECONCILE_SECONDS.labels(trigger="timer")
    ours = set()
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        if name.startswith(("tg_operator_", "trainergroup_")) and not name.endswith("_created"):
            ours.add(name)
    tracker.forget("uid-m3")
    assert ours == metrics.EXPORTED_METRICS
