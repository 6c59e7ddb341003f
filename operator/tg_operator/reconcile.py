"""One reconcile pass: observe once, decide once (pure), act once, write the status.

:func:`advance` is level-triggered and idempotent, and it never waits:

1. validate the spec with tgapi (bad spec: Failed, nothing created);
2. :func:`observe` gathers a :class:`~tg_operator.snapshot.Snapshot` through the ports:
   the RayCluster and its pods (from kopf's indexes), then, only when the Kubernetes
   side is ready, the dashboard's answer, the server job, its output and the actors;
3. :func:`tg_operator.decide.decide` turns the snapshot into one decision (the rules,
   their order and what each does are in that module and in docs/operator.md);
4. :func:`perform` runs the decision's one action (create or delete the RayCluster,
   submit or stop the server job, wait for a job slot, one teardown step), writes the
   status if it changed and posts the events, and returns a :class:`Step`: settled, or
   "look again in N seconds". The group's loop (:mod:`tg_operator.group_loop`) sleeps
   until then or until a watch on the RayCluster, its pods or the spec wakes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Mapping
from typing import Any

from tg_operator import (
    actions,
    claims,
    decide,
    errors,
    events,
    metrics,
    names,
    observed,
    outcomes,
    queue,
    tinker,
)
from tg_operator import status as status_mod
from tg_operator.context import Context, Step
from tg_operator.dashboard import DashboardError, JobInfo
from tg_operator.events import EventSink
from tg_operator.ports import Dashboard
from tg_operator.snapshot import (
    Decision,
    Settings,
    Snapshot,
    SubmitServer,
    TearDown,
    TinkerSeen,
)
from tgapi import (
    SpecErrors,
    TrainerGroup,
    TrainerGroupStatus,
    markers,
    parse_resource,
    parse_status,
    to_wire,
)
from tgapi.progress import parse_progress_file, progress_filename

TINKER_WATCH_GRACE = datetime.timedelta(seconds=30)
"""How long a Tinker server this process created may stay unseen by the Deployment watch
before the operator takes it as missing (deleted meanwhile) and creates it again."""

log = logging.getLogger(__name__)


def format_spec_errors(exc: SpecErrors) -> str:
    return "invalid spec: " + "; ".join(
        f"{e.field}: {e.problem} (fix: {e.fix})" for e in exc.errors
    )


async def write_status(
    ctx: Context,
    *,
    namespace: str,
    name: str,
    uid: str,
    old: TrainerGroupStatus,
    new: TrainerGroupStatus,
    sink: EventSink,
) -> None:
    """Patch the status subresource if it changed; post an event on a phase change."""
    if new == old:
        return
    wire = to_wire(new)
    if new.mesh is None:
        wire["mesh"] = None
    if new.training is not None and new.training.loss is None:
        wire["training"]["loss"] = None  # a merge patch keeps an absent key: remove the old loss
    version = await ctx.kube.patch_trainergroup_status(namespace=namespace, name=name, status=wire)
    if new.phase != old.phase:
        events.phase_changed(sink, old=old.phase, new=new.phase, message=new.message)
        log.info("%s/%s: %s -> %s: %s", namespace, name, old.phase, new.phase, new.message)
    metrics.STATUS_WRITES.inc()
    ctx.written[uid] = (new, version or "")
    ctx.phases.written(uid, namespace=namespace, name=name, status=new)


def bare_snapshot(ctx: Context, tg: TrainerGroup, status: TrainerGroupStatus) -> Snapshot:
    """A snapshot with nothing observed yet."""
    cluster = names.cluster_name(tg)
    return Snapshot(
        tg=tg,
        status=status,
        now=ctx.clock(),
        dashboard_url=ctx.config.dashboard_url(cluster=cluster, namespace=tg.namespace),
        ray_address=ctx.config.gcs_address(cluster=cluster, namespace=tg.namespace),
    )


async def observe(ctx: Context, bare: Snapshot) -> Snapshot:
    """Fill ``bare`` in: Kubernetes first, then only the Ray reads the decision needs."""
    tg, kube = bare.tg, ctx.kube
    cluster = names.cluster_name(tg)
    rc = await kube.get_raycluster(namespace=tg.namespace, name=cluster)
    pods = []
    if rc is not None:
        pods = await kube.list_cluster_pods(namespace=tg.namespace, cluster=cluster)
    snap = dataclasses.replace(bare, raycluster=rc, pods=tuple(pods))
    claim = claims.claim_name(tg)
    if rc is None and claim is not None:  # about to create the cluster: can the claim serve it?
        found = await kube.get_claim(namespace=tg.namespace, name=claim)
        snap = dataclasses.replace(snap, claim=found)
    if rc is not None and queue.suspended(rc):
        uid = str(rc.get("metadata", {}).get("uid") or "")
        workloads = await kube.list_workloads(namespace=tg.namespace, cluster_uid=uid)
        workload = queue.workload_of(workloads, cluster_uid=uid)
        snap = dataclasses.replace(snap, workload=workload)
        q = tg.spec.queue
        if workload is None and q is not None and q.priority_class:
            # Kueue makes no Workload (and posts no event) for a missing priority class
            exists = await kube.workload_priority_class_exists(name=q.priority_class)
            snap = dataclasses.replace(snap, priority_class_exists=exists)
    if tinker.wanted(tg):
        deployment = await kube.get_tinker_deployment(namespace=tg.namespace, group=tg.name)
        created = ctx.tinker_created.get(tg.uid)
        if deployment is not None or (
            created is not None and ctx.clock() - created > TINKER_WATCH_GRACE
        ):
            ctx.tinker_created.pop(tg.uid, None)
            created = None
        seen = TinkerSeen(deployment=deployment, just_created=created is not None)
        snap = dataclasses.replace(snap, tinker=seen)
    reads = observed.ray_reads(snap)
    if not reads.probe:
        return snap
    dash = await ctx.group_dashboard(tg, snap.dashboard_url)
    try:
        await dash.version()
        alive = await dash.alive_worker_nodes() if ctx.config.ray_node_check else None
    except DashboardError as exc:
        return dataclasses.replace(snap, dashboard_error=str(exc))
    snap = dataclasses.replace(snap, alive_worker_nodes=alive)
    url, sid = snap.dashboard_url, observed.submission_id(snap)
    if reads.job:
        try:
            job = await dash.get_job(sid)
            logs = await dash.job_logs(sid) if job is not None and job.terminal else ""
        except DashboardError as exc:
            return dataclasses.replace(snap, ray_error=str(exc))
        _sync_slot(ctx, url=url, submission_id=sid, job=job)
        snap = dataclasses.replace(snap, job=job, job_logs=logs)
    record = observed.group_record(snap)
    if record is not None:
        try:
            actors = await dash.list_actors(ray_namespace=observed.ray_namespace(snap))
            snap = dataclasses.replace(snap, actors=tuple(actors))
        except DashboardError as exc:
            snap = dataclasses.replace(snap, actors_error=str(exc))
        snap = await _read_training(dash, snap, record)
    if reads.job and snap.job is None:
        slots = ctx.slots
        snap = dataclasses.replace(
            snap,
            slot_free=slots.has_room(url, sid),
            slots_in_flight=slots.in_flight(url),
            slot_limit=slots.limit,
        )
    return snap


async def _read_training(
    dash: Dashboard, snap: Snapshot, record: markers.GroupReady
) -> Snapshot:
    """Rank 0's progress file, from the node rank 0 runs on (tgapi.progress)."""
    node_id = observed.rank0_node(snap, record)
    if node_id is None:
        return snap
    filename = progress_filename(ray_namespace=record.ray_namespace, group_name=record.group_name)
    try:
        text = await dash.node_log_file(node_id=node_id, filename=filename)
    except DashboardError as exc:
        return dataclasses.replace(snap, training_error=str(exc))
    return dataclasses.replace(snap, training=parse_progress_file(text or ""))


def _sync_slot(ctx: Context, *, url: str, submission_id: str, job: JobInfo | None) -> None:
    """Keep the job slots in line with Ray: adopt a running job (after an operator
    restart), give back the slot of a finished one."""
    if job is None:
        return
    if job.terminal:
        ctx.slots.release(url, submission_id)
    else:
        ctx.slots.acquire(url, submission_id)


async def perform(ctx: Context, snap: Snapshot, decision: Decision, *, sink: EventSink) -> Step:
    """Run the decision's action, write its status, post its events; the step to return."""
    tg, action = snap.tg, decision.action
    try:
        if isinstance(action, TearDown):
            decision = await actions.tear_down(ctx, snap, decision)
        elif isinstance(action, SubmitServer):
            if not await actions.submit(ctx, snap, action, sink=sink):
                # another group took the last slot since the snapshot: decide again
                in_flight = ctx.slots.in_flight(snap.dashboard_url)
                busy = dataclasses.replace(snap, slot_free=False, slots_in_flight=in_flight)
                settings = Settings.from_config(ctx.config)
                return await perform(ctx, busy, decide.decide(busy, settings=settings), sink=sink)
        elif action is not None:
            await actions.act(ctx, snap, action, sink=sink)
    except DashboardError as exc:
        decision = outcomes.ray_failed(snap, str(exc))
    await write_status(
        ctx,
        namespace=tg.namespace,
        name=tg.name,
        uid=tg.uid,
        old=snap.status,
        new=decision.status,
        sink=sink,
    )
    for event in decision.events:
        sink.post(type=event.type, reason=event.reason, message=event.message)
    if decision.newly_dead:
        metrics.DEAD_WORKERS.inc(decision.newly_dead)
    if decision.restarted:
        metrics.WORKER_RESTARTS.inc()
    if decision.failure:
        metrics.RECONCILE_ERRORS.labels(reason=decision.failure).inc()
        log.warning(
            "%s/%s: Failed (%s): %s",
            tg.namespace,
            tg.name,
            decision.failure,
            decision.status.message,
        )
    return decision.step


def current_status(ctx: Context, obj: Mapping[str, Any]) -> TrainerGroupStatus:
    """The status to start from: the object's, unless this process wrote a newer one.

    The watch may not have delivered the operator's own last write yet; the
    resourceVersion that write returned tells which is newer (an etcd revision;
    if either is not a number, the operator's own write wins).
    """
    meta = obj.get("metadata", {})
    mine = ctx.written.get(str(meta.get("uid", "")))
    if mine is not None and not _seen(str(meta.get("resourceVersion") or ""), mine[1]):
        return mine[0]
    return parse_status(obj.get("status"))


def _seen(body_version: str, written_version: str) -> bool:
    """Whether a body at ``body_version`` already includes the write at ``written_version``."""
    if body_version.isdigit() and written_version.isdigit():
        return int(body_version) >= int(written_version)
    return False


async def advance(ctx: Context, *, obj: Mapping[str, Any], sink: EventSink) -> Step:
    """One reconcile pass for one TrainerGroup body (see the module docstring)."""
    meta = obj.get("metadata", {})
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    async with ctx.lock(namespace=namespace, name=name):
        if meta.get("deletionTimestamp"):
            return Step.settled("the object is being deleted")
        previous = current_status(ctx, obj)
        try:
            tg = parse_resource(dict(obj))
        except SpecErrors as exc:
            message = format_spec_errors(exc)
            generation = int(meta.get("generation") or 0)
            new = status_mod.failed(
                previous,
                reason="InvalidSpec",
                message=message,
                now=ctx.clock(),
                generation=generation,
            )
            if new != previous:
                await write_status(
                    ctx,
                    namespace=namespace,
                    name=name,
                    uid=str(meta.get("uid", "")),
                    old=previous,
                    new=new,
                    sink=sink,
                )
                events.warn(sink, reason="InvalidSpec", message=message)
                metrics.RECONCILE_ERRORS.labels(reason="InvalidSpec").inc()
            return Step.settled(message)
        ctx.use_cluster(namespace=namespace, cluster=names.cluster_name(tg), name=name)
        if previous.phase == "Failed" and previous.observed_generation == tg.generation:
            ctx.phases.written(tg.uid, namespace=namespace, name=name, status=previous)
            return Step.settled(f"Failed: {previous.message}")
        bare = bare_snapshot(ctx, tg, previous)
        try:
            snap = await observe(ctx, bare)
            decision = decide.decide(snap, settings=Settings.from_config(ctx.config))
            return await perform(ctx, snap, decision, sink=sink)
        except errors.GroupFailed as exc:  # from I/O: e.g. the group's Ray token cannot be made
            bare = dataclasses.replace(bare, status=current_status(ctx, obj))
            failed = outcomes.fail(
                bare, bare.status, rule="io-failed", error=type(exc), message=exc.message
            )
            return await perform(ctx, bare, failed, sink=sink)
