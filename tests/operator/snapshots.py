"""Snapshots for the pure decision tests: a ready RayCluster, a running group, Ray's answers."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from tests.operator.fakes import T0
from tests.operator.helpers import pod, trainergroup
from tg_operator import names, raycluster, spec_change
from tg_operator.dashboard import ActorInfo, JobInfo
from tg_operator.snapshot import Settings, Snapshot
from tg_operator.status import rfc3339
from tgapi import TrainerGroup, TrainerGroupStatus, markers

SETTINGS = Settings(restart_backoff_s=10.0, restart_backoff_max_s=300.0)
TG = trainergroup()
SID = names.server_submission_id(TG, generation=0)
WORKERS = ["w0-0", "w0-1"]


def ago(seconds: float) -> str:
    return str(rfc3339(T0 - datetime.timedelta(seconds=seconds)))


def cluster(tg: TrainerGroup = TG, *, cluster_hash: str | None = None) -> dict[str, Any]:
    rc: dict[str, Any] = raycluster.build_raycluster(
        tg, cluster_hash=cluster_hash or spec_change.cluster_hash(tg.spec)
    )
    rc["status"] = {"conditions": [{"type": "RayClusterProvisioned", "status": "True"}]}
    return rc


READY_PODS = (pod("demo-head", node_type="head"), pod("demo-worker-0", node_type="worker"))


def snap(
    *, tg: TrainerGroup = TG, status: TrainerGroupStatus | None = None, **seen: Any
) -> Snapshot:
    """A ready RayCluster and its Ready pods, unless ``seen`` says otherwise."""
    fields: dict[str, Any] = {"raycluster": cluster(tg), "pods": READY_PODS, **seen}
    return Snapshot(
        tg=tg,
        status=status or TrainerGroupStatus(),
        now=T0,
        dashboard_url="http://demo-head-svc.team-a:8265",
        ray_address="demo-head-svc.team-a:6379",
        **fields,
    )


def running(**changes: Any) -> TrainerGroupStatus:
    """The status of a group that reached Ready (generation 0)."""
    base = TrainerGroupStatus(
        phase="Ready",
        phase_since=ago(600),
        submission_id=SID,
        spec_hash=spec_change.group_hash(TG.spec),
        cluster_hash=spec_change.cluster_hash(TG.spec),
        worker_names=list(WORKERS),
        world_size=2,
        ray_namespace=TG.ray_namespace,
        observed_generation=1,
    )
    return dataclasses.replace(base, **changes)


def actors(*dead: str) -> tuple[ActorInfo, ...]:
    return tuple(
        ActorInfo(
            actor_id=f"id-{w}",
            name=w,
            state="DEAD" if w in dead else "ALIVE",
            death_cause="exit 1" if w in dead else "",
        )
        for w in WORKERS
    )


def job(status: str, *, started_s_ago: float = 5.0) -> JobInfo:
    start = int((T0.timestamp() - started_s_ago) * 1000)
    return JobInfo(submission_id=SID, status=status, start_time_ms=start, message="exit 1")


READY_LINE = markers.line(
    markers.GroupReady(
        group_name="demo",
        ray_namespace=TG.ray_namespace,
        generation=0,
        worker_names=tuple(WORKERS),
        world_size=2,
        mesh={"tp": 1, "pp": 1, "cp": 1, "dp": 2},
    )
)
