"""Decisions every rule can end in: Failed with a reason, or "Ray did not answer" (pure)."""

from __future__ import annotations

from tg_operator import errors
from tg_operator import status as status_mod
from tg_operator.backoff import RAY_RETRY_S
from tg_operator.context import Step
from tg_operator.snapshot import Action, Decision, Event, Snapshot
from tgapi import TrainerGroupStatus


def fail(
    snap: Snapshot,
    base: TrainerGroupStatus,
    *,
    rule: str,
    error: type[errors.GroupFailed],
    message: str,
    action: Action | None = None,
    events: tuple[Event, ...] = (),
    newly_dead: int = 0,
) -> Decision:
    """Phase Failed with ``error``'s reason; settled until the spec changes."""
    st = status_mod.failed(
        base, reason=error.reason, message=message, now=snap.now, generation=snap.tg.generation
    )
    return Decision(
        rule=rule,
        status=st,
        step=Step.settled(f"Failed: {message}"),
        action=action,
        events=(*events, Event(type="Warning", reason=error.reason, message=message)),
        failure=error.reason,
        newly_dead=newly_dead,
    )


def ray_failed(snap: Snapshot, error: str) -> Decision:
    """A Ray read or write failed: say so, keep the phase, look again soon."""
    msg = f"Ray dashboard error: {error}"
    st = status_mod.with_phase(snap.status, phase=snap.status.phase, message=msg, now=snap.now)
    return Decision(rule="ray-error", status=st, step=Step.wait(RAY_RETRY_S, msg))


# -- the rules, in order -------------------------------------------------------------------
