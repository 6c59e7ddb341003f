"""Prometheus metrics: the operator's own (``tg_operator_*``) and one series per group
(``trainergroup_*``, labels ``namespace`` and ``name``).

The operator's: reconcile counts, errors and durations, groups by phase, restarts, status
writes. The groups': the last status the operator wrote for each group, read at scrape time
by :class:`GroupCollector` (so a deleted group's series go with it): training step, loss,
tokens/s and last-step time, phase (1 for the current one), restarts, seconds queued.
:data:`EXPORTED_METRICS` names every metric; the chart's Grafana dashboard may use only these
(tests/deploy/test_grafana_dashboard.py). Served on ``TG_METRICS_PORT`` at ``/metrics`` by
:func:`serve`.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tg_operator import status as status_mod
from tgapi import PHASES, TrainerGroupStatus
from tgapi.status import QUEUED

RECONCILES = Counter(
    "tg_operator_reconciles_total",
    "Reconcile passes, by trigger (create/update/resume/timer/delete) and result.",
    ["trigger", "result"],
)
RECONCILE_ERRORS = Counter(
    "tg_operator_reconcile_errors_total",
    "Reconcile passes that ended in an error, by reason.",
    ["reason"],
)
RECONCILE_SECONDS = Histogram(
    "tg_operator_reconcile_duration_seconds",
    "Duration of one reconcile pass.",
    ["trigger"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
GROUPS = Gauge(
    "tg_operator_trainergroups", "TrainerGroups known to the operator, by phase.", ["phase"]
)
WORKER_RESTARTS = Counter(
    "tg_operator_worker_restarts_total", "Worker groups re-created after a worker died."
)
DEAD_WORKERS = Counter("tg_operator_dead_workers_total", "Dead workers detected.")
STATUS_WRITES = Counter(
    "tg_operator_status_writes_total",
    "Status patches written (at most one per reconcile pass, only on a change).",
)

GROUP_LABELS = ("namespace", "name")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupView:
    namespace: str
    name: str
    status: TrainerGroupStatus


class GroupCollector(Collector):
    """The ``trainergroup_*`` series, from the last status written for each group."""

    def __init__(self) -> None:
        self._views: dict[str, GroupView] = {}
        self._lock = threading.Lock()

    def put(self, uid: str, view: GroupView) -> None:
        with self._lock:
            self._views[uid] = view

    def drop(self, uid: str) -> None:
        with self._lock:
            self._views.pop(uid, None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            views = list(self._views.values())
        now = datetime.datetime.now(datetime.UTC)
        step = GaugeMetricFamily(
            "trainergroup_training_step",
            "Optimizer steps the group has taken.",
            labels=GROUP_LABELS,
        )
        loss = GaugeMetricFamily(
            "trainergroup_training_loss",
            "Loss of the group's last optimizer step.",
            labels=GROUP_LABELS,
        )
        tps = GaugeMetricFamily(
            "trainergroup_training_tokens_per_second",
            "Tokens per second of the group's last optimizer step.",
            labels=GROUP_LABELS,
        )
        last = GaugeMetricFamily(
            "trainergroup_training_last_step_timestamp_seconds",
            "When the group's last optimizer step ended (Unix time).",
            labels=GROUP_LABELS,
        )
        phase = GaugeMetricFamily(
            "trainergroup_phase",
            "The group's phase: 1 for the current one, 0 for the others.",
            labels=(*GROUP_LABELS, "phase"),
        )
        restarts = CounterMetricFamily(
            "trainergroup_restarts",
            "Re-creations of the group after failures.",
            labels=GROUP_LABELS,
        )
        queued = GaugeMetricFamily(
            "trainergroup_queue_wait_seconds",
            "Seconds the group has been waiting in its Kueue queue (0 when not queued).",
            labels=GROUP_LABELS,
        )
        for v in views:
            key, st = [v.namespace, v.name], v.status
            for p in PHASES:
                phase.add_metric([*key, p], 1.0 if st.phase == p else 0.0)
            restarts.add_metric(key, float(st.restarts))
            waited = status_mod.seconds_in_phase(st, now=now) if st.phase == QUEUED else 0.0
            queued.add_metric(key, waited)
            t = st.training
            if t is None:
                continue
            step.add_metric(key, float(t.step))
            if t.loss is not None:
                loss.add_metric(key, t.loss)
            if t.tokens_per_second is not None:
                tps.add_metric(key, t.tokens_per_second)
            at = status_mod.parse_rfc3339(t.last_step_time)
            if at is not None:
                last.add_metric(key, at.timestamp())
        yield from (step, loss, tps, last, phase, restarts, queued)


GROUP_SERIES = GroupCollector()
REGISTRY.register(GROUP_SERIES)

EXPORTED_METRICS = frozenset(
    {
        "tg_operator_reconciles_total",
        "tg_operator_reconcile_errors_total",
        "tg_operator_reconcile_duration_seconds",
        "tg_operator_trainergroups",
        "tg_operator_worker_restarts_total",
        "tg_operator_dead_workers_total",
        "tg_operator_status_writes_total",
        "trainergroup_training_step",
        "trainergroup_training_loss",
        "trainergroup_training_tokens_per_second",
        "trainergroup_training_last_step_timestamp_seconds",
        "trainergroup_phase",
        "trainergroup_restarts_total",
        "trainergroup_queue_wait_seconds",
    }
)
"""Every metric name /metrics carries (a counter's samples end in ``_total``)."""


class PhaseTracker:
    """Remembers each object's phase so the by-phase gauge stays exact."""

    def __init__(self) -> None:
        self._phases: dict[str, str] = {}
        self._lock = threading.Lock()
        for phase in PHASES:
            GROUPS.labels(phase=phase).set(0)

    def set(self, uid: str, phase: str) -> None:
        with self._lock:
            self._phases[uid] = phase
            self._publish()

    def written(self, uid: str, *, namespace: str, name: str, status: TrainerGroupStatus) -> None:
        """A status was written for the group: its phase and its ``trainergroup_*`` series."""
        GROUP_SERIES.put(uid, GroupView(namespace=namespace, name=name, status=status))
        self.set(uid, status.phase)

    def forget(self, uid: str) -> None:
        GROUP_SERIES.drop(uid)
        with self._lock:
            self._phases.pop(uid, None)
            self._publish()

    def _publish(self) -> None:
        counts = dict.fromkeys(PHASES, 0)
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in counts.items():
            GROUPS.labels(phase=phase).set(n)


def serve(port: int) -> None:
    """Start the /metrics HTTP server in a daemon thread (port 0: disabled)."""
    if port > 0:
        start_http_server(port)
