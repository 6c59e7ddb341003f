"""Prometheus metrics: reconcile counts, errors and durations, groups by phase, restarts.

Served on ``TG_METRICS_PORT`` at ``/metrics`` by :func:`serve`.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from tgapi import PHASES

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

    def forget(self, uid: str) -> None:
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
