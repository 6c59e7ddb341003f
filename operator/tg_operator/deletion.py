"""The finalizer: clean the Ray side before the TrainerGroup (and its RayCluster) go.

On deletion the group's server job is stopped if it still runs and the teardown
entrypoint kills its actors and placement groups; the State API must then show no
live worker before the finalizer is released. :func:`finalize_step` looks once and
acts once; the group's loop calls it until it is done (kopf keeps the finalizer
while the loop runs). When Ray cannot be reached the loop retries with a growing
delay and says why in the status and in an event. The annotation
``trainergroup.io/force-delete: "true"`` lets an admin remove the object without
the cleanup. An owned RayCluster that is already gone (or going) took its Ray
processes with it, so there is nothing left to clean.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from tg_operator import events, group_teardown, names, reconcile
from tg_operator import status as status_mod
from tg_operator.context import Context, Step
from tg_operator.dashboard import DashboardError
from tg_operator.events import EventSink
from tgapi import SpecErrors, TrainerGroup, TrainerGroupStatus, parse_resource

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


def backoff(retry: int) -> float:
    return float(min(MAX_BACKOFF_S, 2.0 ** min(retry, 10)))


def force_requested(body: Mapping[str, Any]) -> bool:
    annotations = body.get("metadata", {}).get("annotations") or {}
    return str(annotations.get(names.FORCE_DELETE_ANNOTATION, "")).lower() == "true"


async def finalize_step(
    ctx: Context, *, body: Mapping[str, Any], sink: EventSink, attempt: int
) -> Step:
    """One cleanup step for a deleted TrainerGroup: settled when the finalizer may go."""
    meta = body.get("metadata", {})
    namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
    async with ctx.lock(namespace=namespace, name=name):
        step = await _finalize(ctx, body=body, sink=sink, attempt=attempt)
        if step.done:
            ctx.forget(namespace=namespace, name=name, uid=uid)
            ctx.slots.release_prefix(names.job_prefix(namespace=namespace, name=name, uid=uid))
        return step


async def _finalize(
    ctx: Context, *, body: Mapping[str, Any], sink: EventSink, attempt: int
) -> Step:
    meta = body.get("metadata", {})
    namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
    previous = reconcile.current_status(ctx, body)
    st = status_mod.terminating(
        previous, message=previous.message if previous.phase == "Terminating" else "cleaning up",
        now=ctx.clock(),
    )

    async def report(message: str) -> None:
        nonlocal st
        new = dataclasses.replace(st, message=message[:1000])
        await reconcile.write_status(
            ctx, namespace=namespace, name=name, uid=uid, old=st, new=new, sink=sink
        )
        st = new

    await reconcile.write_status(
        ctx, namespace=namespace, name=name, uid=uid, old=previous, new=st, sink=sink
    )
    if force_requested(body):
        msg = (
            f"{names.FORCE_DELETE_ANNOTATION}=true: removed without cleaning Ray; "
            f"actors in Ray namespace {previous.ray_namespace or '?'} may remain"
        )
        events.warn(sink, reason="ForceDeleted", message=msg)
        return Step.settled(msg)
    try:
        tg = parse_resource(dict(body))
    except SpecErrors:
        return Step.settled("the spec was invalid, so nothing was created")
    url = previous.dashboard_url or ctx.config.dashboard_url(
        cluster=names.cluster_name(tg), namespace=namespace
    )
    if not previous.submission_id and not await _server_job_exists(
        ctx, tg=tg, url=url, generation=previous.group_generation
    ):
        return Step.settled("no worker group was started for the current generation")
    if names.owns_cluster(tg):
        rc = await ctx.kube.get_raycluster(namespace=namespace, name=names.cluster_name(tg))
        if rc is None or rc.get("metadata", {}).get("deletionTimestamp"):
            msg = f"RayCluster {names.cluster_name(tg)} is gone; its Ray processes went with it"
            events.info(sink, reason="NothingToClean", message=msg)
            return Step.settled(msg)
    try:
        msg = await _clean_ray(ctx, tg=tg, status=previous, url=url)
    except DashboardError as exc:
        delay = backoff(attempt)
        why = (
            f"cannot reach Ray to remove the workers ({exc}); retrying in {delay:g}s. "
            f"To remove the object without cleaning Ray, annotate it "
            f'{names.FORCE_DELETE_ANNOTATION}="true"'
        )
        if st.message != why:
            events.warn(sink, reason="CleanupRetrying", message=why)
        await report(why)
        return Step.wait(delay, why)
    except _NotYet as exc:
        await report(str(exc))
        return Step.wait(exc.delay, str(exc))
    events.info(sink, reason="CleanedUp", message=msg)
    if names.owns_cluster(tg):
        await ctx.kube.delete_raycluster(namespace=namespace, name=names.cluster_name(tg))
    return Step.settled(msg)


async def _server_job_exists(ctx: Context, *, tg: TrainerGroup, url: str, generation: int) -> bool:
    """Whether a server job was submitted without the status recording it (a crash window)."""
    sid = names.server_submission_id(tg, generation=generation)
    try:
        return await (await ctx.group_dashboard(tg, url)).get_job(sid) is not None
    except DashboardError:
        return False


class _NotYet(Exception):
    def __init__(self, message: str, *, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


async def _clean_ray(
    ctx: Context, *, tg: TrainerGroup, status: TrainerGroupStatus, url: str
) -> str:
    dash = await ctx.group_dashboard(tg, url)
    ray_ns = status.ray_namespace or tg.ray_namespace
    gen = status.group_generation
    result = await group_teardown.teardown_group(
        dash,
        tg,
        python=ctx.config.python,
        ray_namespace=ray_ns,
        generation=gen,
        slots=ctx.slots,
    )
    if not result.done:
        delay = 5.0 if result.failed else group_teardown.STEP_DELAY_S
        raise _NotYet(f"tearing down the workers: {result.message}", delay=delay)
    actors = await dash.list_actors(ray_namespace=ray_ns)
    ours = set(status.worker_names)
    alive = [a.name for a in actors if a.state != "DEAD" and a.name in ours]
    if alive:
        raise _NotYet(
            f"teardown finished but workers are still alive: {', '.join(sorted(alive)[:5])}",
            delay=2.0,
        )
    removed = await group_teardown.forget_jobs(dash, tg, up_to_generation=gen)
    return (
        f"{result.message}; no live workers left in Ray namespace {ray_ns}; "
        f"{removed} job records removed"
    )
