"""The health check a kopf timer runs for every TrainerGroup.

It re-runs the reconcile flow for groups that are up or coming back up. The flow
reads the workers from the State API: a dead worker makes the phase Degraded with
its rank and cause; with ``restartPolicy: OnFailure`` the group is torn down and
re-created under the next group generation (``restarts`` + 1, new names in the
status); with ``Never`` the phase becomes Failed. Detection takes at most one
timer interval (``TG_HEALTH_INTERVAL_SECONDS``) plus one pass.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tg_operator import errors, names, reconcile
from tg_operator.context import Context, Step
from tg_operator.events import EventSink

log = logging.getLogger(__name__)

WATCHED_PHASES = frozenset({"Ready", "Degraded", "WorkersStarting"})
"""Phases the timer drives; earlier ones belong to the change handlers' retries."""
TIMER_BUDGET_S = 120.0
"""How long one tick may keep going (a restart: teardown, new server job, readiness)."""


def handlers_busy(annotations: Mapping[str, str]) -> bool:
    """Whether kopf's reconcile handler is still retrying (its progress annotation is there).

    Then that handler drives the object and the timer stays out of its way.
    """
    key = f"{names.STORAGE_PREFIX}/{names.RECONCILE_HANDLER}"
    return any(k.startswith(key) for k in annotations)


async def check(
    ctx: Context,
    *,
    namespace: str,
    name: str,
    phase: str,
    annotations: Mapping[str, str],
    sink: EventSink,
) -> Step | None:
    """One health tick; None when the timer leaves the object alone."""
    if phase not in WATCHED_PHASES or handlers_busy(annotations):
        return None
    try:
        return await reconcile.drive(
            ctx, namespace=namespace, name=name, sink=sink, trigger="timer", budget_s=TIMER_BUDGET_S
        )
    except errors.GroupFailed as exc:
        log.warning("%s/%s: %s", namespace, name, exc)
        return Step.settled(str(exc))
