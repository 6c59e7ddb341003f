"""Restart back-off: when a group whose worker died may be re-created (pure functions).

The first re-creation runs at once; each later one waits twice as long as the one
before, from ``TG_RESTART_BACKOFF_SECONDS`` (10 s) up to
``TG_RESTART_BACKOFF_MAX_SECONDS`` (300 s), like a pod's CrashLoopBackOff. After
``spec.maxRestarts`` re-creations the next death makes the phase Failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum

from tgapi import TrainerGroupStatus


def delay_s(*, restarts: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait before re-creation number ``restarts + 1``."""
    if restarts <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2.0 ** min(restarts - 1, 30)))


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
        wait = delay_s(restarts=status.restarts, base_s=base_s, cap_s=cap_s)
        when = now + datetime.timedelta(seconds=wait)
        return Decision(verdict=Verdict.SCHEDULE, due=when, wait_s=wait)
    if now < due:
        return Decision(verdict=Verdict.WAIT, due=due, wait_s=(due - now).total_seconds())
    return Decision(verdict=Verdict.RESTART, due=due)
