"""Training progress as status: ``status.training`` and the ``Training`` condition (pure).

Rank 0 records each optimizer step in a progress file (tgapi.progress); the reconcile pass
reads it on every health tick (:func:`tg_operator.reconcile.observe`) and
:func:`with_training` turns it into status:

* ``status.training``: step, loss, grad norm, tokens/s, time of the last step, runs. Kept as
  it was when a pass could not read the file.
* the ``Training`` condition, while the group is Ready: True (``StepsArriving``) while steps
  end within ``spec.training.stallSeconds`` of each other, False (``Stalled``) once none has
  for that long, Unknown (``NoStepYet``) before the first step. Unknown (``GroupNotReady``)
  in the other phases.

Every message is a function of the recorded step alone, never of the clock, so a status is
written at most once per health tick and only when a step ended or the condition turned.
"""

from __future__ import annotations

import dataclasses
import datetime

from tg_operator import status as status_mod
from tgapi import RunStatus, TrainerGroupStatus, TrainingStatus
from tgapi.progress import TrainingProgress

TRAINING = "Training"
EVALUATED_PHASES = frozenset({"Ready"})
"""Phases in which the condition says True or False; Unknown in the others."""


def training_status(progress: TrainingProgress) -> TrainingStatus:
    when = datetime.datetime.fromtimestamp(progress.last_step_at, tz=datetime.UTC)
    return TrainingStatus(
        step=progress.step,
        loss=progress.loss,
        grad_norm=progress.grad_norm,
        tokens_per_second=progress.tokens_per_s,
        last_step_time=status_mod.rfc3339(when) if progress.last_step_at > 0 else "",
        runs=progress.runs,
        run_list=[
            RunStatus(
                id=r.run_id,
                steps=r.steps,
                last_activity_time=status_mod.rfc3339(
                    datetime.datetime.fromtimestamp(r.last_active, tz=datetime.UTC)
                ),
            )
            for r in progress.run_list
        ],
    )


def seconds_since_step(training: TrainingStatus | None, *, now: datetime.datetime) -> float | None:
    """Seconds since the recorded last step (None: no step recorded)."""
    if training is None or not training.last_step_time:
        return None
    at = status_mod.parse_rfc3339(training.last_step_time)
    return None if at is None else max(0.0, (now - at).total_seconds())


def condition(
    st: TrainerGroupStatus, *, stall_seconds: int, now: datetime.datetime
) -> tuple[str, str, str]:
    """(status, reason, message) of the Training condition for ``st``."""
    training = st.training
    if st.phase not in EVALUATED_PHASES:
        return "Unknown", "GroupNotReady", f"the group is {st.phase}"
    age = seconds_since_step(training, now=now)
    if training is None or age is None or training.step <= 0:
        return "Unknown", "NoStepYet", "no optimizer step recorded yet"
    if stall_seconds > 0 and age > stall_seconds:
        return (
            "False",
            "Stalled",
            f"no optimizer step since step {training.step} at {training.last_step_time}, for "
            f"more than spec.training.stallSeconds ({stall_seconds} s): look at the client "
            "driving the group and at the workers' logs",
        )
    return "True", "StepsArriving", "optimizer steps are arriving"


def with_training(
    st: TrainerGroupStatus,
    *,
    progress: TrainingProgress | None,
    stall_seconds: int,
    now: datetime.datetime,
    generation: int,
) -> TrainerGroupStatus:
    """``st`` with ``status.training`` from ``progress`` (kept when None) and the condition."""
    if progress is not None:
        st = dataclasses.replace(st, training=training_status(progress))
    status, reason, message = condition(st, stall_seconds=stall_seconds, now=now)
    conds = status_mod.set_condition(
        st.conditions,
        type=TRAINING,
        status=status,
        reason=reason,
        message=message,
        now=now,
        generation=generation,
    )
    return dataclasses.replace(st, conditions=conds)
