"""The one action of a decision, performed through the ports (:mod:`tg_operator.ports`).

Reconcile's actions report what they did as a Normal event (RayClusterCreated,
RayClusterReplaced, ServerSubmitted); a teardown step's outcome goes back to the pure
:func:`tg_operator.recreate.after_teardown`, which decides what to write. The finalizer's
actions (:func:`clean`, the last section) return their outcome to the pure
:func:`tg_operator.deletion_rules.after`, which decides the next one.
"""

from __future__ import annotations

import logging

from tg_operator import deletion_rules as rules
from tg_operator import events, names, recreate, security, tinker
from tg_operator.context import Context
from tg_operator.dashboard import DashboardError
from tg_operator.events import EventSink
from tg_operator.group_teardown import forget_jobs, teardown_group
from tg_operator.snapshot import (
    CreateCluster,
    Decision,
    DeleteCluster,
    ServeTinker,
    Snapshot,
    StopServer,
    SubmitServer,
    TearDown,
    WaitForSlot,
)
from tgapi import TrainerGroup

log = logging.getLogger(__name__)


async def submit(ctx: Context, snap: Snapshot, action: SubmitServer, *, sink: EventSink) -> bool:
    """Submit the server job; False when no job slot is free after all."""
    tg, url, sid = snap.tg, snap.dashboard_url, action.submission_id
    if not ctx.slots.acquire(url, sid, waiter=f"{tg.namespace}/{tg.name}"):
        return False
    dash = await ctx.group_dashboard(tg, url)
    if await dash.submit_job(
        submission_id=sid, entrypoint=action.entrypoint, metadata=action.metadata
    ):
        gen = snap.status.group_generation
        events.info(
            sink,
            reason="ServerSubmitted",
            message=f"submitted server job {sid} (group generation {gen})",
        )
    return True


async def act(
    ctx: Context,
    snap: Snapshot,
    action: ServeTinker | CreateCluster | DeleteCluster | StopServer | WaitForSlot,
    *,
    sink: EventSink,
) -> None:
    tg, kube = snap.tg, ctx.kube
    if isinstance(action, ServeTinker):
        await serve_tinker(ctx, tg, action, sink=sink)
    elif isinstance(action, CreateCluster):
        await security.ensure_group_objects(ctx, tg, sink=sink)
        if await kube.create_raycluster(action.body) is not None:
            name = names.cluster_name(tg)
            events.info(sink, reason="RayClusterCreated", message=f"created RayCluster {name}")
    elif isinstance(action, DeleteCluster):
        await kube.delete_raycluster(namespace=tg.namespace, name=action.name)
        events.info(
            sink,
            reason="RayClusterReplaced",
            message=f"the cluster spec changed: deleting RayCluster {action.name} to rebuild it",
        )
    elif isinstance(action, WaitForSlot):
        ctx.slots.wait_for(snap.dashboard_url, waiter=f"{tg.namespace}/{tg.name}")
    else:
        try:  # one teardown step; the rest on deletion or at the next spec change
            dash = await ctx.group_dashboard(tg, snap.dashboard_url)
            await teardown_group(
                dash,
                tg,
                python=ctx.config.python,
                ray_namespace=action.ray_namespace,
                generation=action.generation,
                slots=ctx.slots,
            )
        except DashboardError as exc:
            log.warning("%s/%s: cleanup after timeout failed: %s", tg.namespace, tg.name, exc)


async def serve_tinker(
    ctx: Context, tg: TrainerGroup, action: ServeTinker, *, sink: EventSink
) -> None:
    """Create what is missing: the keys Secret (a fresh key; an existing Secret, with the
    keys users added, is never replaced), then the other objects, the Deployment last."""
    kube = ctx.kube
    if action.update:
        for body in action.bodies:
            await kube.update_deployment(body)
            events.info(
                sink,
                reason="TinkerServerUpdated",
                message=f"the spec changed: replacing the pod of {body['metadata']['name']}",
            )
        return
    if await kube.create_object(tinker.build_keys_secret(tg, key=tinker.new_api_key())):
        events.info(
            sink,
            reason="TinkerKeysCreated",
            message=f"created Secret {action.secret_name} with one random API key",
        )
    for body in action.bodies:
        created = await kube.create_object(body)
        if body["kind"] == "Deployment":
            ctx.tinker_created[tg.uid] = ctx.clock()
        if created and body["kind"] == "Deployment":
            name = body["metadata"]["name"]
            events.info(
                sink,
                reason="TinkerServerCreated",
                message=f"created the Tinker API server {name} (Deployment and Service)",
            )


async def tear_down(ctx: Context, snap: Snapshot, decision: Decision) -> Decision:
    act = decision.action
    assert isinstance(act, TearDown)
    tg = snap.tg
    try:
        dash = await ctx.group_dashboard(tg, act.dashboard_url)
        result = await teardown_group(
            dash,
            tg,
            python=ctx.config.python,
            ray_namespace=act.ray_namespace,
            generation=act.generation,
            slots=ctx.slots,
        )
    except DashboardError as exc:
        return recreate.after_teardown(snap, decision, error=str(exc))
    return recreate.after_teardown(snap, decision, result=result)


# -- the finalizer's actions (tg_operator.deletion) ---------------------------------------
async def clean(
    ctx: Context, snap: rules.DeletionSnapshot, action: rules.CleanupAction
) -> rules.Outcome:
    """One link of the cleanup chain; a dashboard error is an outcome, not an exception."""
    group = snap.group
    assert group is not None, action
    tg = group.tg
    if isinstance(action, rules.DeleteOwnedCluster):
        await ctx.kube.delete_raycluster(namespace=tg.namespace, name=action.name)
        return rules.ClusterDeleted()
    try:
        dash = await ctx.group_dashboard(tg, group.dashboard_url)
        if isinstance(action, rules.TearDownGroup):
            result = await teardown_group(
                dash,
                tg,
                python=ctx.config.python,
                ray_namespace=action.ray_namespace,
                generation=action.generation,
                slots=ctx.slots,
            )
            return rules.TornDown(result=result)
        if isinstance(action, rules.ListWorkers):
            actors = await dash.list_actors(ray_namespace=action.ray_namespace)
            return rules.WorkersListed(actors=tuple(actors))
        removed = await forget_jobs(dash, tg, up_to_generation=action.up_to_generation)
        return rules.JobsForgotten(removed=removed)
    except DashboardError as exc:
        return rules.Unreachable(error=str(exc))
