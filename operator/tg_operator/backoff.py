"""Every back-off of the operator: how long to wait before trying again (pure functions).

One schedule, :func:`doubling` (twice as long each time, from a base up to a cap), used by:

* the restart back-off (reconcile, :mod:`tg_operator.deaths`): when a group whose worker died
  may be re-created. The first re-creation runs at once; each later one waits twice as long
  as the one before, from ``TG_RESTART_BACKOFF_SECONDS`` (10 s) up to
  ``TG_RESTART_BACKOFF_MAX_SECONDS`` (300 s), like a pod's CrashLoopBackOff. After
  ``spec.maxRestarts`` re-creations the next death makes the phase Failed (:func:`decide`);
* the cleanup retry (the finalizer, :mod:`tg_operator.deletion_rules`): Ray cannot be
  reached to remove the workers; the n-th cleanup step waits :func:`cleanup_retry_s`
  (1 s, 2 s, 4 s, ... up to 30 s).

And the fixed waits after a failure: :data:`RAY_RETRY_S` (Ray did not answer a reconcile
pass, or a teardown gave up after all its attempts) and :data:`ERROR_RETRY_S` (a pass
raised).
"""

from __future__ import annotations

import dataclasses
import datetime
import enum

from tgapi import TrainerGroupStatus

RAY_RETRY_S = 5.0
"""How soon to look again after Ray could not be reached, or a teardown gave up."""
ERROR_RETRY_S = 10.0
"""How soon a group's loop runs again after a pass raised (a Kubernetes API error, a bug)."""
CLEANUP_RETRY_BASE_S = 1.0
CLEANUP_RETRY_MAX_S = 30.0
"""The finalizer's retries while Ray cannot be reached: 1 s, doubling, at most 30 s."""


def doubling(*, attempt: int, base_s: float, cap_s: float) -> float:
    """``base_s * 2**attempt`` seconds, at most ``cap_s`` (attempt 0 waits ``base_s``)."""
    return float(min(cap_s, base_s * 2.0 ** min(max(attempt, 0), 30)))


def cleanup_retry_s(*, attempt: int) -> float:
    """How long cleanup step ``attempt`` (0, 1, ...) waits before trying Ray again."""
    return doubling(attempt=attempt, base_s=CLEANUP_RETRY_BASE_S, cap_s=CLEANUP_RETRY_MAX_S)


def restart_delay_s(*, restarts: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before re-creation number ``restarts + 1`` (the first: none)."""
    if restarts <= 0:
        return 0.0
    return doubling(attempt=restarts - 1, base_s=base_s, cap_s=cap_s)


class Verdict(enum.Enum):
    GIVE_UP = "give-up"
    """``restartPolicy: Never``, or ``spec.maxRestarts`` re-creations were made."""
    SCHEDULE = "schedule"
    """First sight of this death: record ``nextRestartTime`` (and restart now if it is due)."""
    WAIT = "wait"
    RESTART = "restart"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    verdict: Verdict
    due: datetime.datetime | None = None
    wait_s: float = 0.0


def decide(
    *,
    status: TrainerGroupStatus,
    restart_policy: str,
    max_restarts: int,
    now: datetime.datetime,
    due: datetime.datetime | None,
    base_s: float,
    cap_s: float,
) -> Decision:
    """What to do about a dead worker, given the restart bookkeeping in ``status``."""
    if restart_policy == "Never" or status.restarts >= max_restarts:
        return Decision(verdict=Verdict.GIVE_UP)
    if due is None:
        wait = restart_delay_s(restarts=status.restarts, base_s=base_s, cap_s=cap_s)
        when = now + datetime.timedelta(seconds=wait)
        return Decision(verdict=Verdict.SCHEDULE, due=when, wait_s=wait)
    if now < due:
        return Decision(verdict=Verdict.WAIT, due=due, wait_s=(due - now).total_seconds())
    return Decision(verdict=Verdict.RESTART, due=due)
