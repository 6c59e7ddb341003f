"""What a :class:`~tg_operator.snapshot.Snapshot` says: pure readers the rules share.

The current server job's id, the group record (from the status, or from the job's
output), the RayCluster's readiness, whether the running group must be torn down
first, and which Ray reads a snapshot needs once its Kubernetes part is gathered.
"""

from __future__ import annotations

import dataclasses

from tg_operator import entrypoints, names, owners, queue, spec_change, training
from tg_operator import status as status_mod
from tg_operator.snapshot import RayReads, Snapshot
from tgapi import TrainerGroupStatus, markers, to_wire


def ray_namespace(snap: Snapshot) -> str:
    """The Ray namespace of the group the status records (``status.rayNamespace``: where its
    workers were started, even after a spec change), else the spec's."""
    return snap.status.ray_namespace or snap.tg.ray_namespace


def submission_id(snap: Snapshot) -> str:
    return names.server_submission_id(snap.tg, generation=snap.status.group_generation)


def recorded(snap: Snapshot) -> markers.GroupReady | None:
    """The group record the status already holds for the current server job."""
    st, tg = snap.status, snap.tg
    if st.submission_id != submission_id(snap) or not st.worker_names:
        return None
    return markers.GroupReady(
        group_name=st.group_name or tg.group_name,
        ray_namespace=ray_namespace(snap),
        generation=st.group_generation,
        worker_names=tuple(st.worker_names),
        world_size=st.world_size or len(st.worker_names),
        mesh=dict(to_wire(st.mesh)) if st.mesh is not None else {},
        device=st.device,
        backend=st.backend,
    )


def group_record(snap: Snapshot) -> markers.GroupReady | None:
    """The group record: from the status, or from a succeeded server job's output."""
    found = recorded(snap)
    if found is None and snap.job is not None and snap.job.status == "SUCCEEDED":
        found = entrypoints.parse_group_ready(snap.job_logs)
    return found


def rank0_node(snap: Snapshot, record: markers.GroupReady) -> str | None:
    """The Ray node id rank 0's actor is alive on (None: not read, not alive, no workers)."""
    if not record.worker_names or snap.actors is None:
        return None
    rank0 = record.worker_names[0]
    for actor in snap.actors:
        if actor.name == rank0 and actor.state == "ALIVE" and actor.node_id:
            return actor.node_id
    return None


def kube_readiness(snap: Snapshot) -> status_mod.ClusterReadiness:
    cluster, tg = names.cluster_name(snap.tg), snap.tg
    rc = snap.raycluster
    if rc is not None and queue.suspended(rc) and not rc.get("metadata", {}).get(
        "deletionTimestamp"
    ):
        q = tg.spec.queue
        msg = queue.admission_message(
            snap.workload,
            queue=q.name if q is not None else "(none: spec.suspend is set)",
            priority_class=q.priority_class if q is not None else None,
            priority_class_exists=snap.priority_class_exists,
        )
        return status_mod.ClusterReadiness(ready=False, reason=status_mod.QUEUED, message=msg)
    ready = status_mod.kube_readiness(
        raycluster_obj=snap.raycluster, pods=snap.pods, cluster=cluster
    )
    if snap.raycluster is None and not names.owns_cluster(tg):
        msg = f"the referenced RayCluster {cluster} does not exist in namespace {tg.namespace}"
        ready = dataclasses.replace(ready, message=msg)
    return ready


def readiness(snap: Snapshot) -> status_mod.ClusterReadiness:
    ready = status_mod.with_dashboard(kube_readiness(snap), dashboard_error=snap.dashboard_error)
    if snap.alive_worker_nodes is None:
        return ready
    return status_mod.with_ray_nodes(ready, alive_workers=snap.alive_worker_nodes)


def teardown_reason(snap: Snapshot) -> tuple[str, bool] | None:
    """Why the running group must go first, and whether that revives a Failed one."""
    st = snap.status
    if not st.submission_id:
        return None  # nothing was started for this generation
    if st.phase == "Failed":
        return "the spec changed after a failure", True
    change = spec_change.classify(st, snap.tg.spec)
    return (
        None
        if change is spec_change.SpecChange.NONE
        else (f"the {change.value} spec changed", False)
    )


def cluster_settled(snap: Snapshot) -> bool:
    """No cluster action is due: the owned RayCluster exists, is ours and is current."""
    rc, tg = snap.raycluster, snap.tg
    if not names.owns_cluster(tg):
        return True
    return rc is not None and owners.is_owned_by(dict(rc), tg) and not outdated(snap)


def ray_reads(snap: Snapshot) -> RayReads:
    """Which Ray reads a snapshot whose Kubernetes part is gathered still needs."""
    if teardown_reason(snap) is not None or not cluster_settled(snap):
        return RayReads()
    if not kube_readiness(snap).ready:
        return RayReads()
    return RayReads(probe=True, job=recorded(snap) is None)


def outdated(snap: Snapshot) -> bool:
    meta = (snap.raycluster or {}).get("metadata", {})
    if meta.get("deletionTimestamp"):
        return False
    have = (meta.get("annotations") or {}).get(names.CLUSTER_HASH_ANNOTATION)
    return bool(have != spec_change.cluster_hash(snap.tg.spec))


def status_from(
    snap: Snapshot,
    ready: status_mod.ClusterReadiness,
    *,
    previous: TrainerGroupStatus | None = None,
    record: markers.GroupReady | None = None,
) -> TrainerGroupStatus:
    obs = status_mod.Observation(
        cluster_name=names.cluster_name(snap.tg),
        dashboard_url=snap.dashboard_url,
        ray_address=snap.ray_address,
        readiness=ready,
        job=snap.job,
        record=record,
        actors=snap.actors if record is not None else None,
        actors_error=snap.actors_error,
    )
    base = snap.status if previous is None else previous
    st = status_mod.compute_status(tg=snap.tg, previous=base, obs=obs, now=snap.now)
    return training.with_training(
        st,
        progress=snap.training,
        stall_seconds=snap.tg.spec.training.stall_seconds,
        now=snap.now,
        generation=snap.tg.generation,
    )


def booked(snap: Snapshot) -> TrainerGroupStatus:
    """The status with the current generation's server job recorded as started."""
    spec = snap.tg.spec
    return dataclasses.replace(
        snap.status,
        submission_id=submission_id(snap),
        spec_hash=spec_change.group_hash(spec),
        cluster_hash=spec_change.cluster_hash(spec),
    )
