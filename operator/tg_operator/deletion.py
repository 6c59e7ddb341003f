"""The finalizer: clean the Ray side before the TrainerGroup (and its RayCluster) go.

A cleanup step follows reconcile's shape, observe -> decide -> act:

1. :func:`observe` fills a :class:`~tg_operator.deletion_rules.DeletionSnapshot`: the
   status, the force annotation, the parsed spec, and only the reads the rules need (the
   server job when the status records none, the owned RayCluster);
2. :func:`tg_operator.deletion_rules.decide` gives one decision (pure; the rules and their
   order are in that module and in docs/operator.md);
3. :func:`perform` runs its action through :func:`tg_operator.actions.clean` and hands the
   outcome to :func:`tg_operator.deletion_rules.after` until no action is left (tear the
   group down, check no worker of ours is alive, forget the job records, delete the owned
   RayCluster), then writes the status once and posts the events.

:func:`finalize_step` is one such step; the group's loop calls it until it is settled
(kopf keeps the finalizer while the loop runs), waiting as long as the step says: a
teardown in progress, the cleanup back-off while Ray cannot be reached, or an owned RayCluster
being deleted that still has finalizers (KubeRay's GCS-FT Redis cleanup uses the token Secret
the group owns; each step reads the RayCluster afresh). The annotation
``trainergroup.io/force-delete: "true"`` lets an admin remove the object without the
cleanup.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tg_operator import actions, names, observed, reconcile
from tg_operator import deletion_rules as rules
from tg_operator.context import Context, Step
from tg_operator.dashboard import DashboardError
from tg_operator.events import EventSink
from tg_operator.snapshot import Snapshot
from tgapi import SpecErrors, parse_resource


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
        snap = await observe(ctx, bare_snapshot(ctx, body=body, attempt=attempt))
        step = await perform(ctx, snap, rules.decide(snap), sink=sink)
        if step.done:
            ctx.forget(namespace=namespace, name=name, uid=uid)
            ctx.slots.release_prefix(names.job_prefix(namespace=namespace, name=name, uid=uid))
        return step


def bare_snapshot(ctx: Context, *, body: Mapping[str, Any], attempt: int) -> rules.DeletionSnapshot:
    """What the object itself says: its status, the force annotation, the parsed spec."""
    meta = body.get("metadata", {})
    previous = reconcile.current_status(ctx, body)
    group: Snapshot | None = None
    try:
        tg = parse_resource(dict(body))
    except SpecErrors:
        pass
    else:
        group = reconcile.bare_snapshot(ctx, tg, previous)
        if previous.dashboard_url:  # where the group was started
            group = dataclasses.replace(group, dashboard_url=previous.dashboard_url)
    return rules.DeletionSnapshot(
        namespace=str(meta.get("namespace")),
        name=str(meta.get("name")),
        uid=str(meta.get("uid")),
        status=previous,
        now=ctx.clock(),
        attempt=attempt,
        force=force_requested(body),
        group=group,
    )


async def observe(ctx: Context, snap: rules.DeletionSnapshot) -> rules.DeletionSnapshot:
    """The reads the rules need, and no others."""
    if rules.wants_job_probe(snap):
        snap = dataclasses.replace(snap, server_job_seen=await _server_job_exists(ctx, snap))
    group = snap.group
    if group is not None and rules.wants_cluster(snap):
        tg = group.tg
        rc = await ctx.kube.get_raycluster(namespace=tg.namespace, name=names.cluster_name(tg))
        snap = dataclasses.replace(snap, group=dataclasses.replace(group, raycluster=rc))
    return snap


async def _server_job_exists(ctx: Context, snap: rules.DeletionSnapshot) -> bool:
    """Whether a server job was submitted without the status recording it (a crash window)."""
    group = snap.group
    assert group is not None
    try:
        dash = await ctx.group_dashboard(group.tg, group.dashboard_url)
        return await dash.get_job(observed.submission_id(group)) is not None
    except DashboardError:
        return False


async def perform(
    ctx: Context, snap: rules.DeletionSnapshot, decision: rules.Cleanup, *, sink: EventSink
) -> Step:
    """Run the chain of actions, write the status once, post the events; the step."""
    while decision.action is not None:
        outcome = await actions.clean(ctx, snap, decision.action)
        decision = rules.after(snap, decision, outcome)
    await reconcile.write_status(
        ctx,
        namespace=snap.namespace,
        name=snap.name,
        uid=snap.uid,
        old=snap.status,
        new=decision.status,
        sink=sink,
    )
    for event in decision.events:
        sink.post(type=event.type, reason=event.reason, message=event.message)
    return decision.step
