"""A group whose workers exist: watch them; a dead one means back-off, re-creation or Failed.

The last rule of :data:`tg_operator.decide.RULES` (pure). With ``restartPolicy:
OnFailure`` a death is re-created under the next group generation after the restart
back-off (:mod:`tg_operator.backoff`); after ``spec.maxRestarts`` re-creations, or with
``Never``, the phase is Failed.
"""

from __future__ import annotations

import dataclasses

from tg_operator import backoff, errors, observed, outcomes, recreate
from tg_operator import status as status_mod
from tg_operator.context import Step
from tg_operator.snapshot import Decision, Event, Settings, Snapshot
from tgapi import TrainerGroupStatus


def workers(snap: Snapshot, cfg: Settings) -> Decision | None:
    """The group exists: watch it; a dead worker means back-off, re-creation or Failed."""
    record = observed.group_record(snap)
    if record is None:
        return None
    new = observed.status_from(
        snap, observed.readiness(snap), previous=observed.booked(snap), record=record
    )
    dead = status_mod.dead_workers(new.workers)
    if not dead:
        # Ready, or Degraded with nobody dead (restarting, state unreadable): keep watching
        return Decision(rule="watch", status=new, step=Step.settled(new.message))
    already = {w.name for w in status_mod.dead_workers(snap.status.workers)}
    newly = sum(1 for w in dead if w.name not in already)
    return _after_death(snap, cfg, new=new, what=status_mod.describe_dead(dead), newly=newly)


def _after_death(
    snap: Snapshot, cfg: Settings, *, new: TrainerGroupStatus, what: str, newly: int
) -> Decision:
    spec, limit = snap.tg.spec, snap.tg.spec.max_restarts
    verdict = backoff.decide(
        status=new,
        restart_policy=spec.restart_policy,
        max_restarts=limit,
        now=snap.now,
        due=status_mod.parse_rfc3339(new.next_restart_time),
        base_s=cfg.restart_backoff_s,
        cap_s=cfg.restart_backoff_max_s,
    )
    nxt = new.restarts + 1
    if verdict.verdict is backoff.Verdict.GIVE_UP:
        if spec.restart_policy == "Never":
            return outcomes.fail(
                snap,
                new,
                rule="worker-died",
                error=errors.WorkerDied,
                message=f"{what} (restartPolicy: Never)",
                newly_dead=newly,
            )
        msg = (
            f"{what}; the group was re-created {new.restarts} times, "
            f"spec.maxRestarts ({limit}) is reached"
        )
        return outcomes.fail(
            snap,
            new,
            rule="restart-limit",
            error=errors.RestartLimit,
            message=msg,
            newly_dead=newly,
        )
    if verdict.verdict is backoff.Verdict.RESTART:
        return recreate.plan(
            snap, rule="restart", base=new, reason=what, restart=True, newly_dead=newly
        )
    assert verdict.due is not None
    due = status_mod.rfc3339(verdict.due)
    waiting = status_mod.with_phase(
        dataclasses.replace(new, next_restart_time=due),
        phase="Degraded",
        message=f"{what}; restart {nxt}/{limit} at {due} (back-off)",
        now=snap.now,
    )
    step = Step.wait(verdict.wait_s, f"restart back-off: {verdict.wait_s:g}s")
    if verdict.verdict is backoff.Verdict.WAIT:
        return Decision(rule="restart-back-off", status=waiting, step=step, newly_dead=newly)
    when = f"in {verdict.wait_s:g}s" if verdict.wait_s > 0 else "now"
    event = Event(
        type="Warning",
        reason="Restarting",
        message=f"{what}; re-creating the group as generation {new.group_generation + 1} "
        f"{when} (restart {nxt} of at most {limit})",
    )
    if verdict.wait_s > 0:
        return Decision(
            rule="restart-scheduled", status=waiting, step=step, events=(event,), newly_dead=newly
        )
    return recreate.plan(
        snap,
        rule="restart",
        base=waiting,
        reason=what,
        restart=True,
        events=(event,),
        newly_dead=newly,
    )
