"""The teardown step's outcome (:func:`tg_operator.recreate.after_teardown`), pure.

Each case starts from a decision of test_decide.py's table that tears the group down,
and gives the step's result (or the dashboard error) to ``after_teardown``.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.operator.snapshots import SETTINGS, running
from tests.operator.test_decide import ROWS
from tg_operator import decide, recreate
from tg_operator.backoff import RAY_RETRY_S
from tg_operator.group_teardown import STEP_DELAY_S, TeardownResult
from tg_operator.snapshot import Decision, Snapshot


def planned(row: str) -> tuple[Snapshot, Decision]:
    seen = ROWS[row][0]
    return seen, decide.decide(seen, settings=SETTINGS)


INCOMPLETE = TeardownResult(done=False, message="teardown job x is FAILED: incomplete")
GAVE_UP = TeardownResult(done=False, failed=True, message="teardown failed 20 times")
DONE = TeardownResult(done=True, message="teardown x: 2 actor(s) killed")


@pytest.mark.parametrize(
    ("row", "result", "error", "generation", "restarts", "delay", "event"),
    [
        ("first-death-restarts-at-once", INCOMPLETE, "", 0, 0, STEP_DELAY_S, "Restarting"),
        ("first-death-restarts-at-once", GAVE_UP, "", 0, 0, RAY_RETRY_S, "Restarting"),
        ("first-death-restarts-at-once", DONE, "", 1, 1, 0.0, "GroupTornDown"),
        ("group-spec-change-tears-down", None, "refused", 0, 0, RAY_RETRY_S, ""),
        ("cluster-spec-change-tears-down", None, "refused", 1, 0, 0.0, "TeardownSkipped"),
        ("spec-change-revives-a-failed-group", DONE, "", 1, 0, 0.0, "GroupTornDown"),
    ],
    ids=["incomplete", "gave-up", "done", "unreachable", "skipped", "revived"],
)
def test_after_teardown(
    row: str,
    result: TeardownResult | None,
    error: str,
    generation: int,
    restarts: int,
    delay: float,
    event: str,
) -> None:
    seen, plan = planned(row)
    if row == "spec-change-revives-a-failed-group":
        seen = dataclasses.replace(seen, status=running(phase="Failed", restarts=7))
        plan = decide.decide(seen, settings=SETTINGS)
    d = recreate.after_teardown(seen, plan, result=result, error=error)
    assert d.status.group_generation == generation and d.status.restarts == restarts
    assert d.step.delay == delay and not d.step.done
    assert (d.events[-1].reason if d.events else "") == event
    if generation == 1:
        assert d.status.submission_id == "" and d.status.worker_names == []
        assert d.status.phase in ("Degraded", "WorkersStarting")
    else:
        assert "group generation 0" in d.status.message
