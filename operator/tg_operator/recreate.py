"""Re-creating a group: plan one teardown step, then decide from its outcome (pure).

A group is re-created after a spec change, after a worker died (``restartPolicy:
OnFailure``), or when a spec change revives a Failed group. :func:`plan` makes the
:class:`~tg_operator.snapshot.TearDown` decision; the executor runs one step of
:func:`tg_operator.group_teardown.teardown_group` and hands its outcome to
:func:`after_teardown`, which says what to write: still tearing down, Ray unreachable
(retry, or skip it when the RayCluster is being rebuilt anyway), or done, in which
case the group moves to the next group generation.
"""

from __future__ import annotations

import dataclasses

from tg_operator import names, observed, spec_change
from tg_operator import status as status_mod
from tg_operator.backoff import RAY_RETRY_S
from tg_operator.context import Step
from tg_operator.group_teardown import STEP_DELAY_S, TeardownResult
from tg_operator.snapshot import Decision, Event, Snapshot, TearDown
from tgapi import TrainerGroupStatus


def plan(
    snap: Snapshot,
    *,
    rule: str,
    base: TrainerGroupStatus,
    reason: str,
    restart: bool = False,
    fresh: bool = False,
    events: tuple[Event, ...] = (),
    newly_dead: int = 0,
) -> Decision:
    """Tear down the current generation (``base``: the status to build on)."""
    tg, gen = snap.tg, base.group_generation
    # Not Ready while being replaced: Degraded after a death; a revived group stays Failed
    # until its old workers are gone; a spec change starts over.
    phase = "Degraded" if restart else "Failed" if fresh else "WorkersStarting"
    message = f"tearing down group generation {gen}: {reason}"
    action = TearDown(
        generation=gen,
        reason=reason,
        dashboard_url=base.dashboard_url or snap.dashboard_url,
        ray_namespace=observed.ray_namespace(snap),
        restart=restart,
        fresh=fresh,
        cluster_going=(
            names.owns_cluster(tg)
            and bool(base.cluster_hash)
            and base.cluster_hash != spec_change.cluster_hash(tg.spec)
        ),
    )
    return Decision(
        rule=rule,
        status=status_mod.with_phase(base, phase=phase, message=message, now=snap.now),
        step=Step.wait(STEP_DELAY_S, message),
        action=action,
        events=events,
        newly_dead=newly_dead,
    )


def after_teardown(
    snap: Snapshot,
    planned: Decision,
    *,
    result: TeardownResult | None = None,
    error: str = "",
) -> Decision:
    """The decision once the teardown step ran: ``result``, or the dashboard ``error``."""
    act = planned.action
    assert isinstance(act, TearDown), planned
    gen = act.generation
    if error:
        if not act.cluster_going:
            msg = f"cannot tear down group generation {gen} ({act.reason}): {error}"
            return _still(snap, planned, message=msg, delay=RAY_RETRY_S)
        skipped = Event(
            type="Warning",
            reason="TeardownSkipped",
            message=f"Ray at {act.dashboard_url} is unreachable and its RayCluster is being "
            f"rebuilt: {error}",
        )
        return _recreated(snap, planned, event=skipped)
    assert result is not None
    if not result.done:
        # keep the reason (which rank died, and why) in the message while the steps run
        msg = f"tearing down group generation {gen} ({act.reason}): {result.message}"
        delay = RAY_RETRY_S if result.failed else STEP_DELAY_S
        return _still(snap, planned, message=msg, delay=delay)
    done = Event(type="Normal", reason="GroupTornDown", message=result.message)
    return _recreated(snap, planned, event=done)


def _still(snap: Snapshot, planned: Decision, *, message: str, delay: float) -> Decision:
    st = planned.status
    return dataclasses.replace(
        planned,
        status=status_mod.with_phase(st, phase=st.phase, message=message, now=snap.now),
        step=Step.wait(delay, message),
    )


def _recreated(snap: Snapshot, planned: Decision, *, event: Event) -> Decision:
    """The next group generation: nothing of the old group is kept but the restart count."""
    act = planned.action
    assert isinstance(act, TearDown)
    st, gen = planned.status, act.generation
    new = dataclasses.replace(
        st,
        group_generation=gen + 1,
        restarts=0 if act.fresh else st.restarts + (1 if act.restart else 0),
        last_restart_time=status_mod.rfc3339(snap.now) if act.restart else st.last_restart_time,
        next_restart_time="",
        submission_id="",
        spec_hash="",
        cluster_hash="",
        worker_names=[],
        workers=[],
        ready_workers=0,
        mesh=None,
    )
    phase = "Degraded" if act.restart else "WorkersStarting"
    message = f"re-creating the group as generation {gen + 1}: {act.reason}"
    return dataclasses.replace(
        planned,
        status=status_mod.with_phase(new, phase=phase, message=message, now=snap.now),
        step=Step.wait(0.0, message),
        events=(*planned.events, event),
        restarted=act.restart,
    )
