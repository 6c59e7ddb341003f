"""The per-group loop (the kopf daemon's body) and the watched reads, against the fakes."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from tests.operator.fakes import World, cluster_key, world
from tests.operator.helpers import pod
from tg_operator import group_loop, names, watched


class FakeStopped:
    """kopf's ``stopped`` flag: falsy until set with a reason."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason: kopf.DaemonStoppingReason | None = None

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self, reason: kopf.DaemonStoppingReason) -> None:
        self.reason = reason
        self._event.set()

    async def wait(self, timeout: float | None = None) -> FakeStopped:
        await asyncio.wait_for(self._event.wait(), timeout=timeout)
        return self


async def until(predicate: Any, *, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


def test_the_loop_reaches_ready_then_cleans_up_on_deletion_and_exits() -> None:
    w = world(env={"TG_HEALTH_INTERVAL_SECONDS": "0.5"})

    async def scenario() -> str:
        stopped = FakeStopped()
        task = asyncio.create_task(
            group_loop.run(w.ctx, body=w.obj, stopped=stopped, sink=w.sink)
        )
        await until(lambda: cluster_key(w) in w.kube.clusters)
        w.kube.make_ready(*cluster_key(w))
        w.ctx.wake_cluster(namespace=cluster_key(w)[0], cluster=cluster_key(w)[1])  # the watch
        await until(lambda: w.status.get("phase") == "Ready")
        assert w.obj["metadata"]["uid"] in w.ctx.looping
        w.obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        stopped.set(kopf.DaemonStoppingReason.RESOURCE_DELETED)
        return await asyncio.wait_for(task, timeout=30)

    message = asyncio.run(scenario())
    assert "no live workers left" in message
    assert cluster_key(w) not in w.kube.clusters  # the owned RayCluster is deleted last
    assert w.kube.released == [cluster_key(w)]  # then the finalizer goes
    assert w.obj["metadata"]["uid"] not in w.ctx.looping
    assert "CleanedUp" in w.reasons() and w.warnings() == []


def test_the_loop_stops_without_cleaning_when_the_operator_exits() -> None:
    w: World = world()

    async def scenario() -> str:
        stopped = FakeStopped()
        task = asyncio.create_task(
            group_loop.run(w.ctx, body=w.obj, stopped=stopped, sink=w.sink)
        )
        await until(lambda: cluster_key(w) in w.kube.clusters)
        stopped.set(kopf.DaemonStoppingReason.OPERATOR_EXITING)
        return await asyncio.wait_for(task, timeout=10)

    assert asyncio.run(scenario()) == "the operator is stopping"
    assert cluster_key(w) in w.kube.clusters


def test_a_wake_from_a_watch_cuts_the_sleep_short() -> None:
    w = world()

    async def scenario() -> float:
        stopped = FakeStopped()
        wake = w.ctx.waker(namespace="team-a", name="demo")
        w.ctx.use_cluster(namespace="team-a", cluster="demo", name="demo")
        loop = asyncio.get_running_loop()
        start = loop.time()
        sleeper = asyncio.create_task(group_loop.sleep(wake, stopped, timeout=60))
        w.ctx.wake_cluster(namespace="team-a", cluster="demo")
        await asyncio.wait_for(sleeper, timeout=5)
        return loop.time() - start

    assert asyncio.run(scenario()) < 5


def test_watched_reads_come_from_the_indexes() -> None:
    w = world()
    rc = {"metadata": {"name": "demo", "namespace": "team-a"}, "spec": {}}
    head = pod("demo-head", node_type="head")
    head["metadata"]["labels"][names.RAY_CLUSTER_LABEL] = "demo"
    head["spec"] = {"containers": [{"name": "ray-head", "image": "big"}]}
    clusters = watched.cluster_entry(namespace="team-a", name="demo", body=rc)
    pods = watched.pod_entry(namespace="team-a", body=head)
    kube = watched.WatchedKube(
        api=w.kube,
        clusters={k: [v] for k, v in clusters.items()},
        pods={k: [v] for k, v in pods.items()},
    )

    async def reads() -> tuple[Any, Any, Any]:
        return (
            await kube.get_raycluster(namespace="team-a", name="demo"),
            await kube.list_cluster_pods(namespace="team-a", cluster="demo"),
            await kube.get_raycluster(namespace="team-a", name="other"),
        )

    found, listed, missing = asyncio.run(reads())
    assert found == rc and missing is None
    assert [p["metadata"]["name"] for p in listed] == ["demo-head"]
    assert "spec" not in listed[0]  # the index keeps only what readiness reads
    # only the miss went to the API server
    assert w.kube.calls == {"get_raycluster": 1}
    assert watched.pod_entry(namespace="team-a", body={"metadata": {"labels": {}}}) == {}
