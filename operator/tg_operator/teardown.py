"""Tear a worker group down through the Ray Jobs API (the teardown entrypoint).

Used before a group is re-created (restart, spec change) and by the finalizer.
It first stops the generation's server job if it still runs, then runs
``tgruntime.teardown`` under deterministic submission ids
``...-teardown-g{generation}-{attempt}``: a failed attempt moves on to the next
id, a restarted operator finds the attempt it already submitted. Dashboard errors
propagate to the caller, which decides whether to retry or to report.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from tg_operator import entrypoints, names
from tg_operator.dashboard import DashboardClient, JobInfo
from tg_operator.job_slots import JobSlots
from tgapi import TrainerGroup, markers

MAX_ATTEMPTS = 20
POLL_S = 0.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeardownResult:
    done: bool
    message: str
    report: markers.Teardown | None = None
    submission_id: str = ""


async def await_terminal(
    dash: DashboardClient, submission_id: str, *, timeout_s: float
) -> JobInfo | None:
    """Poll a job until it is terminal or ``timeout_s`` passed; its last info."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = await dash.get_job(submission_id)
        if job is None or job.terminal or time.monotonic() >= deadline:
            return job
        await asyncio.sleep(POLL_S)


async def teardown_group(
    dash: DashboardClient,
    tg: TrainerGroup,
    *,
    python: str,
    ray_namespace: str,
    generation: int,
    budget_s: float = 60.0,
    slots: JobSlots | None = None,
) -> TeardownResult:
    """Kill the group's actors and placement groups; idempotent."""
    deadline = time.monotonic() + budget_s
    url = dash.base_url
    server_id = names.server_submission_id(tg, generation=generation)
    server = await dash.get_job(server_id)
    if server is not None and not server.terminal:
        await dash.stop_job(server_id)
        server = await await_terminal(
            dash, server_id, timeout_s=max(1.0, deadline - time.monotonic())
        )
        if server is not None and not server.terminal:
            return TeardownResult(
                done=False, message=f"waiting for server job {server_id} to stop ({server.status})"
            )
    if slots is not None:
        slots.release(url, server_id)
    last_error = ""
    for attempt in range(MAX_ATTEMPTS):
        tid = names.teardown_submission_id(tg, generation=generation, attempt=attempt)
        job = await dash.get_job(tid)
        if job is None:
            if slots is not None and not slots.acquire(url, tid):
                return TeardownResult(
                    done=False,
                    message=f"waiting for a free Ray job slot ({slots.in_flight(url)} jobs "
                    f"in flight, TG_MAX_CONCURRENT_JOBS={slots.limit})",
                )
            await dash.submit_job(
                submission_id=tid,
                entrypoint=entrypoints.teardown_entrypoint(
                    tg, python=python, ray_namespace=ray_namespace
                ),
                metadata=entrypoints.job_metadata(tg, generation=generation),
            )
        if job is None or not job.terminal:
            job = await await_terminal(dash, tid, timeout_s=max(1.0, deadline - time.monotonic()))
        if job is not None and job.terminal and slots is not None:
            slots.release(url, tid)
        if job is None or not job.terminal:
            state = job.status if job is not None else "PENDING"
            return TeardownResult(
                done=False, message=f"teardown job {tid} is {state}", submission_id=tid
            )
        logs = await dash.job_logs(tid)
        report = entrypoints.parse_teardown(logs)
        if job.status == "SUCCEEDED" and (report is None or report.complete):
            summary = (
                f"{len(report.actors_killed)} actor(s) killed, "
                f"{len(report.placement_groups_removed)} placement group(s) removed"
                if report is not None
                else "done"
            )
            return TeardownResult(
                done=True, message=f"teardown {tid}: {summary}", report=report, submission_id=tid
            )
        # An incomplete teardown (the entrypoint exits 3 and reports complete: false; an older
        # runtime exited 0 with the same report) is never taken as done: the next attempt runs
        # and the group is not re-created meanwhile.
        why = f"incomplete: {'; '.join(report.errors) or report}" if report else ""
        last_error = (
            f"teardown job {tid} {job.status}: {why or entrypoints.tail(logs) or job.message}"
        )
    return TeardownResult(
        done=False, message=f"teardown failed {MAX_ATTEMPTS} times; last: {last_error}"
    )


async def forget_jobs(dash: DashboardClient, tg: TrainerGroup, *, up_to_generation: int) -> int:
    """Delete the finished job records of generations 0..N (best effort); how many went."""
    removed = 0
    for gen in range(up_to_generation + 1):
        ids = [names.server_submission_id(tg, generation=gen)]
        ids += [
            names.teardown_submission_id(tg, generation=gen, attempt=a) for a in range(MAX_ATTEMPTS)
        ]
        for sid in ids:
            job = await dash.get_job(sid)
            if job is None:
                if "-teardown-" in sid:
                    break  # attempts are consecutive
                continue
            if job.terminal and await dash.delete_job(sid):
                removed += 1
    return removed
