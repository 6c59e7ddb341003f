"""The operator never takes an incomplete teardown as done (pure decision logic, a fake Jobs API).

The real teardown entrypoint's incomplete exit is exercised against a real Ray in
tests/runtime/test_teardown_exit.py; here a small in-memory stand-in for the Jobs API plays
back what Ray would answer, so every outcome is checked in milliseconds.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from tests.operator.helpers import trainergroup
from tg_operator import group_teardown, names
from tg_operator.dashboard import JobInfo
from tg_operator.ports import Dashboard
from tgapi import markers


class FakeJobs:
    """Jobs API playback: each submitted teardown job ends as the next (status, report) says."""

    base_url = "http://ray.invalid:8265"

    def __init__(self, outcomes: list[tuple[str, markers.Teardown]]) -> None:
        self.outcomes = list(outcomes)
        self.jobs: dict[str, JobInfo] = {}
        self.logs: dict[str, str] = {}
        self.submitted: list[str] = []

    async def get_job(self, submission_id: str) -> JobInfo | None:
        return self.jobs.get(submission_id)

    async def stop_job(self, submission_id: str) -> bool:
        return True

    async def submit_job(self, *, submission_id: str, entrypoint: str, **_: Any) -> bool:
        status, report = self.outcomes.pop(0)
        self.submitted.append(submission_id)
        self.jobs[submission_id] = JobInfo(submission_id=submission_id, status=status)
        self.logs[submission_id] = f"noise\n{markers.line(report)}\n"
        return True

    async def job_logs(self, submission_id: str) -> str:
        return self.logs.get(submission_id, "")


def run(
    outcomes: list[tuple[str, markers.Teardown]],
) -> tuple[group_teardown.TeardownResult, FakeJobs]:
    """Step the teardown as the group's loop does, until it is done or gives up."""
    tg = trainergroup()
    dash = FakeJobs(outcomes)

    async def steps() -> group_teardown.TeardownResult:
        for _ in range(3 * group_teardown.MAX_ATTEMPTS):
            result = await group_teardown.teardown_group(
                cast(Dashboard, dash),  # FakeJobs has the calls teardown makes
                tg,
                python="python",
                ray_namespace=tg.ray_namespace,
                generation=0,
            )
            if result.done or result.failed:
                return result
        raise AssertionError("the teardown neither finished nor gave up")

    return asyncio.run(steps()), dash


COMPLETE = markers.Teardown(
    group_name="x", ray_namespace="tg-x", complete=True, actors_killed=("a",)
)
INCOMPLETE = markers.Teardown(
    group_name="x", ray_namespace="tg-x", errors=("placement group tg:x:0 still exists",)
)


def test_a_complete_teardown_is_done() -> None:
    result, dash = run([("SUCCEEDED", COMPLETE)])
    assert result.done and result.report == COMPLETE
    assert len(dash.submitted) == 1


def test_an_incomplete_teardown_is_retried_under_the_next_attempt_id() -> None:
    # the runtime exits 3 (FAILED) when incomplete; an older one exited 0 with the same report
    result, dash = run([("FAILED", INCOMPLETE), ("SUCCEEDED", INCOMPLETE), ("SUCCEEDED", COMPLETE)])
    assert result.done
    tg = trainergroup()
    assert dash.submitted == [
        names.teardown_submission_id(tg, generation=0, attempt=a) for a in range(3)
    ]


def test_a_teardown_that_never_completes_is_never_done() -> None:
    result, dash = run([("FAILED", INCOMPLETE)] * group_teardown.MAX_ATTEMPTS)
    assert not result.done and result.failed
    assert len(dash.submitted) == group_teardown.MAX_ATTEMPTS
    assert "still exists" in result.message
