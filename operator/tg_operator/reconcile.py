"""One reconcile pass: TrainerGroup → RayCluster → server job → workers → status.

:func:`advance` is level-triggered and idempotent, and it never waits. It reads the
world once (the RayCluster and its pods from kopf's indexes, the server job and the
actors from the Ray dashboard), acts once, writes the status and returns a
:class:`Step`: settled, or "look again in N seconds". The group's loop
(:mod:`tg_operator.group_loop`) sleeps until then or until a watch on the
RayCluster, its pods or the spec wakes it. In order:

1. validate the spec with tgapi (bad spec: Failed, nothing created);
2. re-create the group if the spec fields it was built from changed;
3. ensure the RayCluster (create it, owned, or find the referenced one) and check
   honest readiness (KubeRay conditions, every pod Ready, Unschedulable messages,
   the dashboard answering), bounded by ``timeouts.clusterReadySeconds``;
4. submit the server entrypoint under a deterministic submission id (GET before
   POST; an existing job is adopted), look at it on later passes, bounded by
   ``timeouts.workersReadySeconds``, and read ``TG_GROUP_READY`` from its logs;
5. read the workers from the State API; a dead one makes the group Degraded and,
   with ``restartPolicy: OnFailure``, re-creates it under the next group
   generation after the restart back-off (:mod:`tg_operator.backoff`); after
   ``spec.maxRestarts`` re-creations, or with ``Never``, the phase is Failed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from tg_operator import (
    backoff,
    entrypoints,
    errors,
    events,
    metrics,
    names,
    raycluster,
    security,
    spec_change,
)
from tg_operator import status as status_mod
from tg_operator.context import Context, Step
from tg_operator.dashboard import ActorInfo, DashboardError, JobInfo
from tg_operator.events import EventSink
from tg_operator.ports import Dashboard
from tg_operator.teardown import STEP_DELAY_S, teardown_group
from tgapi import (
    SpecErrors,
    TrainerGroup,
    TrainerGroupStatus,
    markers,
    parse_resource,
    parse_status,
    to_wire,
)

log = logging.getLogger(__name__)

WORKERS_GRACE_S = 60.0
"""Extra time the server job gets beyond ``workersReadySeconds`` (it has its own timeout)."""
WATCH_FALLBACK_S = 30.0
"""Longest sleep while the watches on the RayCluster and its pods should wake the group."""
DASHBOARD_POLL_S = 2.0
"""Pods are Ready but the dashboard does not answer yet (nothing watchable)."""
JOB_POLL_S = 1.0
"""Looking at a running server job (Ray has no watch)."""
RAY_RETRY_S = 5.0
SLOT_WAIT_S = 30.0
"""Fallback while waiting for a job slot (a freed slot wakes the waiters at once)."""


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
    version = await ctx.kube.patch_trainergroup_status(
        namespace=namespace, name=name, status=wire
    )
    if new.phase != old.phase:
        events.phase_changed(sink, old=old.phase, new=new.phase, message=new.message)
        log.info("%s/%s: %s -> %s: %s", namespace, name, old.phase, new.phase, new.message)
    ctx.written[uid] = (new, version or "")
    ctx.phases.set(uid, new.phase)


class _Pass:
    """One call of :func:`advance` for one object (holds what was written so far)."""

    def __init__(
        self, ctx: Context, *, tg: TrainerGroup, status: TrainerGroupStatus, sink: EventSink
    ) -> None:
        self.ctx = ctx
        self.tg = tg
        self.written = status
        self.sink = sink
        self.now = ctx.clock()
        self.cluster = names.cluster_name(tg)
        self.dashboard_url = ctx.config.dashboard_url(cluster=self.cluster, namespace=tg.namespace)
        self.ray_address = ctx.config.gcs_address(cluster=self.cluster, namespace=tg.namespace)

    async def write(self, new: TrainerGroupStatus) -> None:
        await write_status(
            self.ctx,
            namespace=self.tg.namespace,
            name=self.tg.name,
            uid=self.tg.uid,
            old=self.written,
            new=new,
            sink=self.sink,
        )
        self.written = new

    async def fail(self, error: errors.GroupFailed) -> errors.GroupFailed:
        st = status_mod.failed(
            self.written,
            reason=error.reason,
            message=error.message,
            now=self.now,
            generation=self.tg.generation,
        )
        await self.write(st)
        events.warn(self.sink, reason=error.reason, message=error.message)
        metrics.RECONCILE_ERRORS.labels(reason=error.reason).inc()
        return error

    def observation(
        self,
        readiness: status_mod.ClusterReadiness,
        *,
        job: JobInfo | None = None,
        record: markers.GroupReady | None = None,
        actors: list[ActorInfo] | None = None,
        actors_error: str = "",
    ) -> status_mod.Observation:
        return status_mod.Observation(
            cluster_name=self.cluster,
            dashboard_url=self.dashboard_url,
            ray_address=self.ray_address,
            readiness=readiness,
            job=job,
            record=record,
            actors=actors,
            actors_error=actors_error,
        )

    def compute(self, obs: status_mod.Observation) -> TrainerGroupStatus:
        return status_mod.compute_status(tg=self.tg, previous=self.written, obs=obs, now=self.now)

    # -- the flow ---------------------------------------------------------------------
    async def run(self) -> Step:
        tg, st = self.tg, self.written
        if st.phase == "Failed" and st.submission_id:
            # A new spec generation revives a failed group: start it over.
            step = await self.recreate(reason="the spec changed after a failure", fresh=True)
            if step is not None:
                return step
        change = spec_change.classify(self.written, tg.spec)
        if change is not spec_change.SpecChange.NONE:
            step = await self.recreate(reason=f"the {change.value} spec changed")
            if step is not None:
                return step
        readiness = await self.ensure_cluster()
        if not readiness.ready:
            new = self.compute(self.observation(readiness))
            limit = tg.spec.timeouts.cluster_ready_seconds
            if (
                new.phase == "ClusterProvisioning"
                and status_mod.seconds_in_phase(new, now=self.now) > limit
            ):
                await self.write(new)
                raise await self.fail(
                    errors.ClusterTimeout(
                        f"the RayCluster was not ready within timeouts.clusterReadySeconds "
                        f"({limit}s): {readiness.message}"
                    )
                )
            await self.write(new)
            left = limit - status_mod.seconds_in_phase(new, now=self.now)
            delay = DASHBOARD_POLL_S if readiness.reason == "DashboardUnreachable" else min(
                WATCH_FALLBACK_S, max(1.0, left + 1.0)
            )
            return Step.wait(delay, readiness.message)
        dash = await self.ctx.group_dashboard(self.tg, self.dashboard_url)
        try:
            return await self.run_group(dash, readiness)
        except DashboardError as exc:
            msg = f"Ray dashboard error: {exc}"
            await self.write(
                status_mod.with_phase(
                    self.written, phase=self.written.phase, message=msg, now=self.now
                )
            )
            return Step.wait(RAY_RETRY_S, msg)

    async def ensure_cluster(self) -> status_mod.ClusterReadiness:
        tg, kube = self.tg, self.ctx.kube
        rc = await kube.get_raycluster(namespace=tg.namespace, name=self.cluster)
        if names.owns_cluster(tg):
            want = spec_change.cluster_hash(tg.spec)
            if rc is None:
                await security.ensure_group_objects(self.ctx, tg, sink=self.sink)
                created = await kube.create_raycluster(
                    raycluster.build_raycluster(tg, cluster_hash=want)
                )
                if created is not None:
                    events.info(
                        self.sink,
                        reason="RayClusterCreated",
                        message=f"created RayCluster {self.cluster}",
                    )
                rc = created or await kube.get_raycluster(namespace=tg.namespace, name=self.cluster)
            elif not raycluster.is_owned_by(rc, tg):
                raise await self.fail(
                    errors.ClusterConflict(
                        f"RayCluster {self.cluster} already exists and is not owned by this "
                        f"TrainerGroup: delete it, or use spec.rayClusterRef to run on it"
                    )
                )
            elif (
                not rc.get("metadata", {}).get("deletionTimestamp")
                and rc.get("metadata", {}).get("annotations", {}).get(names.CLUSTER_HASH_ANNOTATION)
                != want
            ):
                await kube.delete_raycluster(namespace=tg.namespace, name=self.cluster)
                events.info(
                    self.sink,
                    reason="RayClusterReplaced",
                    message=f"the cluster spec changed: deleting RayCluster {self.cluster} to rebuild it",
                )
                return status_mod.ClusterReadiness(
                    ready=False,
                    reason="RayClusterReplacing",
                    message=f"replacing RayCluster {self.cluster} (its spec changed)",
                )
        pods = (
            await kube.list_cluster_pods(namespace=tg.namespace, cluster=self.cluster)
            if rc is not None
            else []
        )
        readiness = status_mod.kube_readiness(raycluster_obj=rc, pods=pods, cluster=self.cluster)
        if rc is None and not names.owns_cluster(tg):
            readiness = dataclasses.replace(
                readiness,
                message=f"the referenced RayCluster {self.cluster} does not exist in namespace "
                f"{tg.namespace}",
            )
        if not readiness.ready:
            return readiness
        try:
            dash = await self.ctx.group_dashboard(tg, self.dashboard_url)
            await dash.version()
            seen = await dash.alive_worker_nodes()
        except DashboardError as exc:
            return status_mod.with_dashboard(readiness, dashboard_error=str(exc))
        return status_mod.with_ray_nodes(readiness, alive_workers=seen)

    async def run_group(
        self, dash: Dashboard, readiness: status_mod.ClusterReadiness
    ) -> Step:
        tg, st = self.tg, self.written
        gen = st.group_generation
        sid = names.server_submission_id(tg, generation=gen)
        job: JobInfo | None = None
        if st.submission_id == sid and st.worker_names:
            record = markers.GroupReady(
                group_name=st.group_name or tg.group_name,
                ray_namespace=st.ray_namespace or tg.ray_namespace,
                generation=gen,
                worker_names=tuple(st.worker_names),
                world_size=st.world_size or len(st.worker_names),
                mesh=dict(to_wire(st.mesh)) if st.mesh is not None else {},
                device=st.device,
                backend=st.backend,
            )
        else:
            job = await dash.get_job(sid)
            slots, url = self.ctx.slots, self.dashboard_url
            waiter = f"{tg.namespace}/{tg.name}"
            if job is None and not slots.acquire(url, sid, waiter=waiter):
                msg = (
                    f"waiting for a free Ray job slot: {slots.in_flight(url)} jobs in flight on "
                    f"this Ray cluster (TG_MAX_CONCURRENT_JOBS={slots.limit})"
                )
                new = self.compute(self.observation(readiness))
                await self.write(
                    status_mod.with_phase(new, phase=new.phase, message=msg, now=self.now)
                )
                return Step.wait(SLOT_WAIT_S, msg)
            if job is not None and not job.terminal:
                slots.acquire(url, sid)  # adopt a job found running (after a restart)
            if job is None:
                created = await dash.submit_job(
                    submission_id=sid,
                    entrypoint=entrypoints.server_entrypoint(
                        tg, python=self.ctx.config.python, generation=gen
                    ),
                    metadata=entrypoints.job_metadata(tg, generation=gen),
                )
                if created:
                    events.info(
                        self.sink,
                        reason="ServerSubmitted",
                        message=f"submitted server job {sid} (group generation {gen})",
                    )
                job = await dash.get_job(sid)
            if job is not None and job.terminal:
                slots.release(url, sid)
            st = dataclasses.replace(
                st,
                group_generation=gen,
                submission_id=sid,
                spec_hash=spec_change.group_hash(tg.spec),
                cluster_hash=spec_change.cluster_hash(tg.spec),
            )
            if job is None or not job.terminal:
                now_s = self.now.timestamp()
                started = (job.start_time_ms / 1000.0) if job and job.start_time_ms else now_s
                limit = tg.spec.timeouts.workers_ready_seconds
                if now_s - started > limit + WORKERS_GRACE_S:
                    await self.write(self._with_bookkeeping(st, readiness, job))
                    await self._stop_and_clean(dash, gen)
                    raise await self.fail(
                        errors.WorkersTimeout(
                            f"server job {sid} did not finish within timeouts.workersReadySeconds "
                            f"({limit}s) + {WORKERS_GRACE_S:g}s; it was stopped, and its workers "
                            "are removed on deletion or on the next spec change"
                        )
                    )
                await self.write(self._with_bookkeeping(st, readiness, job))
                return Step.wait(
                    JOB_POLL_S, f"server job {sid} is {job.status if job else 'PENDING'}"
                )
            logs = await dash.job_logs(sid)
            if job.status == "SUCCEEDED":
                maybe = entrypoints.parse_group_ready(logs)
                if maybe is None:
                    await self.write(self._with_bookkeeping(st, readiness, job))
                    raise await self.fail(
                        errors.ServerFailed(
                            f"server job {sid} succeeded but printed no {entrypoints.READY_MARKER} "
                            f"line; last output: {entrypoints.tail(logs)}"
                        )
                    )
                record = maybe
            else:
                why = entrypoints.parse_group_failed(logs) or (
                    f"{job.message} last output: {entrypoints.tail(logs)}"
                )
                await self.write(self._with_bookkeeping(st, readiness, job))
                raise await self.fail(errors.ServerFailed(f"server job {sid} {job.status}: {why}"))
        return await self.check_workers(dash, readiness, st=st, job=job, record=record)

    def _booked(self, st: TrainerGroupStatus) -> TrainerGroupStatus:
        """The written status plus the group bookkeeping decided in this pass."""
        return dataclasses.replace(
            self.written,
            group_generation=st.group_generation,
            submission_id=st.submission_id,
            spec_hash=st.spec_hash,
            cluster_hash=st.cluster_hash,
        )

    def _with_bookkeeping(
        self,
        st: TrainerGroupStatus,
        readiness: status_mod.ClusterReadiness,
        job: JobInfo | None,
    ) -> TrainerGroupStatus:
        return status_mod.compute_status(
            tg=self.tg,
            previous=self._booked(st),
            obs=self.observation(readiness, job=job),
            now=self.now,
        )

    async def check_workers(
        self,
        dash: Dashboard,
        readiness: status_mod.ClusterReadiness,
        *,
        st: TrainerGroupStatus,
        job: JobInfo | None,
        record: markers.GroupReady,
    ) -> Step:
        tg = self.tg
        base = self._booked(st)
        try:
            actors = await dash.list_actors(ray_namespace=record.ray_namespace or tg.ray_namespace)
            obs = self.observation(readiness, job=job, record=record, actors=actors)
        except DashboardError as exc:
            obs = self.observation(readiness, job=job, record=record, actors_error=str(exc))
        new = status_mod.compute_status(tg=tg, previous=base, obs=obs, now=self.now)
        dead = status_mod.dead_workers(new.workers)
        if not dead:
            # Ready, or Degraded with nobody dead (restarting, state unreadable): the
            # health timer keeps watching.
            await self.write(new)
            return Step.settled(new.message)
        already = {w.name for w in status_mod.dead_workers(self.written.workers)}
        metrics.DEAD_WORKERS.inc(len([w for w in dead if w.name not in already]))
        await self.write(new)
        what = status_mod.describe_dead(dead)
        return await self.restart_after_death(what)

    async def restart_after_death(self, what: str) -> Step:
        """Back-off, then re-create; or Failed (``Never``, or ``spec.maxRestarts`` reached)."""
        tg, st, cfg = self.tg, self.written, self.ctx.config
        limit = tg.spec.max_restarts
        decision = backoff.decide(
            status=st,
            restart_policy=tg.spec.restart_policy,
            max_restarts=limit,
            now=self.now,
            due=status_mod.parse_rfc3339(st.next_restart_time),
            base_s=cfg.restart_backoff_s,
            cap_s=cfg.restart_backoff_max_s,
        )
        if decision.verdict is backoff.Verdict.GIVE_UP:
            if tg.spec.restart_policy == "Never":
                raise await self.fail(errors.WorkerDied(f"{what} (restartPolicy: Never)"))
            raise await self.fail(
                errors.RestartLimit(
                    f"{what}; the group was re-created {st.restarts} times, "
                    f"spec.maxRestarts ({limit}) is reached"
                )
            )
        if decision.verdict is backoff.Verdict.SCHEDULE:
            assert decision.due is not None
            nxt = st.restarts + 1
            when = f"in {decision.wait_s:g}s" if decision.wait_s > 0 else "now"
            events.warn(
                self.sink,
                reason="Restarting",
                message=f"{what}; re-creating the group as generation "
                f"{st.group_generation + 1} {when} (restart {nxt} of at most {limit})",
            )
            await self.write(
                status_mod.with_phase(
                    dataclasses.replace(st, next_restart_time=status_mod.rfc3339(decision.due)),
                    phase="Degraded",
                    message=f"{what}; restart {nxt}/{limit} {when} (back-off)",
                    now=self.now,
                )
            )
            if decision.wait_s > 0:
                return Step.wait(decision.wait_s, f"restart back-off: {decision.wait_s:g}s")
        elif decision.verdict is backoff.Verdict.WAIT:
            return Step.wait(decision.wait_s, f"restart back-off: {decision.wait_s:g}s left")
        step = await self.recreate(reason=what, restart=True)
        return step or Step.wait(0.0, "re-created the group")

    async def _stop_and_clean(self, dash: Dashboard, gen: int) -> None:
        """Stop a server job that ran too long (one teardown step; the rest on deletion)."""
        try:
            await teardown_group(
                dash,
                self.tg,
                python=self.ctx.config.python,
                ray_namespace=self.written.ray_namespace or self.tg.ray_namespace,
                generation=gen,
                slots=self.ctx.slots,
            )
        except DashboardError as exc:
            log.warning(
                "%s/%s: cleanup after timeout failed: %s", self.tg.namespace, self.tg.name, exc
            )

    async def recreate(
        self, *, reason: str, restart: bool = False, fresh: bool = False
    ) -> Step | None:
        """Tear the current group down and move to the next group generation.

        Returns None when the group is gone and the flow may go on, or a wait. ``fresh``
        (a spec change revives a Failed group) gives the group its restart budget back.
        """
        tg, st = self.tg, self.written
        gen = st.group_generation
        if not st.submission_id:
            return None  # nothing was started for this generation
        url = st.dashboard_url or self.dashboard_url
        dash = await self.ctx.group_dashboard(tg, url)
        cluster_going = (
            names.owns_cluster(tg)
            and bool(st.cluster_hash)
            and st.cluster_hash != spec_change.cluster_hash(tg.spec)
        )
        # A group being replaced is not Ready: Degraded after a death, else starting over.
        phase = "Degraded" if restart else "WorkersStarting"
        await self.write(
            status_mod.with_phase(
                st,
                phase=phase,
                message=f"tearing down group generation {gen}: {reason}",
                now=self.now,
            )
        )
        st = self.written
        try:
            result = await teardown_group(
                dash,
                tg,
                python=self.ctx.config.python,
                ray_namespace=st.ray_namespace or tg.ray_namespace,
                generation=gen,
                slots=self.ctx.slots,
            )
        except DashboardError as exc:
            if not cluster_going:
                msg = f"cannot tear down group generation {gen} ({reason}): {exc}"
                await self.write(
                    status_mod.with_phase(st, phase=st.phase, message=msg, now=self.now)
                )
                return Step.wait(RAY_RETRY_S, msg)
            result = None
            events.warn(
                self.sink,
                reason="TeardownSkipped",
                message=f"Ray at {url} is unreachable and its RayCluster is being rebuilt: {exc}",
            )
        if result is not None and not result.done:
            # keep the reason (which rank died, and why) in the message while the steps run
            msg = f"tearing down group generation {gen} ({reason}): {result.message}"
            await self.write(status_mod.with_phase(st, phase=st.phase, message=msg, now=self.now))
            return Step.wait(RAY_RETRY_S if result.failed else STEP_DELAY_S, msg)
        if result is not None:
            events.info(self.sink, reason="GroupTornDown", message=result.message)
        new = dataclasses.replace(
            st,
            group_generation=gen + 1,
            restarts=0 if fresh else st.restarts + (1 if restart else 0),
            last_restart_time=status_mod.rfc3339(self.now) if restart else st.last_restart_time,
            next_restart_time="",
            submission_id="",
            spec_hash="",
            cluster_hash="",
            worker_names=[],
            workers=[],
            ready_workers=0,
            mesh=None,
        )
        new = status_mod.with_phase(
            new,
            phase="Degraded" if restart else new.phase,
            message=f"re-creating the group as generation {gen + 1}: {reason}",
            now=self.now,
        )
        if restart:
            metrics.WORKER_RESTARTS.inc()
        await self.write(new)
        return None


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
                previous, reason="InvalidSpec", message=message, now=ctx.clock(),
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
            ctx.phases.set(tg.uid, previous.phase)
            return Step.settled(f"Failed: {previous.message}")
        try:
            return await _Pass(ctx, tg=tg, status=previous, sink=sink).run()
        except errors.GroupFailed as exc:
            log.warning("%s/%s: Failed (%s): %s", namespace, name, exc.reason, exc.message)
            return Step.settled(f"Failed: {exc.message}")
