"""Tear a worker group down through the Ray Jobs API (the teardown entrypoint), one step a call.

Used before a group is re-created (restart, spec change) and by the finalizer.
:func:`teardown_group` looks once and acts once: it stops the generation's server
job if it still runs, then runs ``tgruntime.entrypoints.teardown`` under deterministic
submission ids ``...-teardown-g{generation}-{attempt}`` (a failed attempt moves
on to the next id; a restarted operator finds the attempt it already submitted).
It never waits: a job still running gives ``done=False`` and the caller looks
again later (the group's loop, :mod:`tg_operator.group_loop`). Dashboard errors
propagate to the caller, which decides whether to retry or to report.
"""

from __future__ import annotations

import dataclasses

from tg_operator import entrypoints, names
from tg_operator.job_slots import JobSlots
from tg_operator.ports import Dashboard
from tgapi import TrainerGroup, markers

MAX_ATTEMPTS = 20
STEP_DELAY_S = 1.0
"""How soon the caller looks again at a teardown that is not done."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeardownResult:
    done: bool
    message: str
    report: markers.Teardown | None = None
    submission_id: str = ""
    failed: bool = False
    """Every attempt failed: retrying at once will not help."""


async def teardown_group(
    dash: Dashboard,
    tg: TrainerGroup,
    *,
    python: str,
    ray_namespace: str,
    generation: int,
    slots: JobSlots | None = None,
) -> TeardownResult:
    """One step of killing the group's actors and placement groups; idempotent."""
    url = dash.base_url
    server_id = names.server_submission_id(tg, generation=generation)
    server = await dash.get_job(server_id)
    if server is not None and not server.terminal:
        if server.status != "STOPPING":
            await dash.stop_job(server_id)
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
            waiter = f"{tg.namespace}/{tg.name}"
            if slots is not None and not slots.acquire(url, tid, waiter=waiter):
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
            return TeardownResult(
                done=False, message=f"submitted teardown job {tid}", submission_id=tid
            )
        if not job.terminal:
            return TeardownResult(
                done=False, message=f"teardown job {tid} is {job.status}", submission_id=tid
            )
        if slots is not None:
            slots.release(url, tid)
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
        done=False,
        failed=True,
        message=f"teardown failed {MAX_ATTEMPTS} times; last: {last_error}",
    )


async def forget_jobs(dash: Dashboard, tg: TrainerGroup, *, up_to_generation: int) -> int:
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
