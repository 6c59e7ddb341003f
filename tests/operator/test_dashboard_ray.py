"""The Ray dashboard client against a real local Ray (Jobs and State APIs)."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from tests.operator.conftest import RayEndpoint
from tg_operator.dashboard import ActorInfo, DashboardClient, DashboardUnreachable, JobInfo
from tg_operator.settings import ray_auth_token

pytestmark = pytest.mark.ray
T = TypeVar("T")


async def await_terminal(d: DashboardClient, sid: str, *, timeout_s: float) -> JobInfo | None:
    """Poll a job until it is terminal or ``timeout_s`` passed (the operator never waits)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        job = await d.get_job(sid)
        if job is None or job.terminal or asyncio.get_running_loop().time() > deadline:
            return job
        await asyncio.sleep(0.5)


async def actors_once(
    d: DashboardClient, ns: str, state: str, *, timeout_s: float, job: str | None = None
) -> list[ActorInfo]:
    """The namespace's actors once one is in ``state``; sooner when ``timeout_s`` passed or
    the job ``job`` is gone or terminal (then as they are)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        actors = await d.list_actors(ray_namespace=ns)
        if any(a.state == state for a in actors) or asyncio.get_running_loop().time() > deadline:
            return actors
        if job is not None:
            info = await d.get_job(job)
            if info is None or info.terminal:
                return actors
        await asyncio.sleep(0.5)


def run(ray_endpoint: RayEndpoint, fn: Callable[[DashboardClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with aiohttp.ClientSession() as session:
            client = DashboardClient(
                base_url=ray_endpoint.dashboard_url,
                session=session,
                timeout_s=30,
                token=ray_auth_token(os.environ),
            )
            return await fn(client)

    return asyncio.run(main())


def py(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def test_a_job_is_submitted_once_its_actor_reported_alive_then_killed_and_its_logs_read(
    ray_endpoint: RayEndpoint, tmp_path: Path
) -> None:
    """One job proves the Jobs and State APIs together (every job costs Ray a supervisor
    worker and its driver a Ray connection, ~5 CPU s): it is submitted once (a second
    submission of its id is refused), its driver creates a detached actor that the State API
    lists ALIVE, then kills it on the test's go-ahead (a file) and the State API lists it
    DEAD with the cause; the job ends SUCCEEDED with its metadata and exit code, its log is
    read and its record deleted. That a detached actor outlives the process that created it
    is tests/runtime/test_controller_lifecycle.py's
    test_create_in_one_process_attach_from_another_then_teardown."""
    sid = ns = f"tgop-test-{uuid.uuid4().hex[:8]}"
    go = tmp_path / "kill-now"
    driver = (
        "import os, sys, time, ray\n"
        f"ray.init(namespace={ns!r})\n"
        "@ray.remote(num_cpus=0)\n"
        "class W:\n"
        "    def ping(self): return 1\n"
        "a = W.options(name='w0', lifetime='detached').remote(); ray.get(a.ping.remote())\n"
        "print(1, flush=True)\n"
        "deadline = time.monotonic() + 300\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    if time.monotonic() > deadline:\n"
        "        ray.kill(a); sys.exit('no go-ahead from the test in 300 s')\n"
        "    time.sleep(0.2)\n"
        "ray.kill(ray.get_actor('w0'))\n"
    )

    async def flow(d: DashboardClient) -> dict[str, Any]:
        assert (await d.version())["ray_version"]
        assert await d.get_job(sid) is None
        assert await d.list_actors(ray_namespace=ns) == []
        got: dict[str, Any] = {
            "first": await d.submit_job(
                submission_id=sid, entrypoint=py(driver), metadata={"trainergroup.io/uid": "x"}
            ),
            "again": await d.submit_job(submission_id=sid, entrypoint=py("print(2)")),
        }
        try:
            got["alive"] = await actors_once(d, ns, "ALIVE", timeout_s=300, job=sid)
        finally:
            go.touch()  # the driver kills the actor and exits
        got["job"] = await await_terminal(d, sid, timeout_s=300)
        got["dead"] = await actors_once(d, ns, "DEAD", timeout_s=20)
        got["logs"] = await d.job_logs(sid)
        got["deleted"] = await d.delete_job(sid)
        got["after"] = await d.get_job(sid)
        return got

    got = run(ray_endpoint, flow)
    job, logs = got["job"], got["logs"]
    assert (got["first"], got["again"]) == (True, False)
    assert [a.state for a in got["alive"]] == ["ALIVE"], (got["alive"], job, logs)
    assert job is not None and job.status == "SUCCEEDED", (job, logs)
    assert job.metadata.get("trainergroup.io/uid") == "x"
    assert job.start_time_ms and job.driver_exit_code == 0
    assert "1" in logs.splitlines()
    dead = [(a.state, a.death_cause) for a in got["dead"]]
    assert len(dead) == 1 and dead[0][0] == "DEAD", dead
    assert "ray.kill" in dead[0][1]
    assert got["deleted"] and got["after"] is None


def test_missing_jobs_and_unreachable_dashboards_are_clear(ray_endpoint: RayEndpoint) -> None:
    async def flow(d: DashboardClient) -> tuple[bool, bool]:
        return await d.stop_job("tgop-no-such-job"), await d.delete_job("tgop-no-such-job")

    assert run(ray_endpoint, flow) == (False, False)

    async def unreachable() -> None:
        async with aiohttp.ClientSession() as session:
            await DashboardClient(base_url="http://127.0.0.1:9", session=session).version()

    with pytest.raises(DashboardUnreachable) as info:
        asyncio.run(unreachable())
    assert "http://127.0.0.1:9/api/version" in str(info.value)
    assert "cannot connect" in str(info.value)


def test_the_node_table_counts_no_head_as_a_worker_node(ray_endpoint: RayEndpoint) -> None:
    # a local Ray is one node, its head: no worker node (a RayCluster's workers are the others)
    assert run(ray_endpoint, lambda d: d.alive_worker_nodes()) == 0
