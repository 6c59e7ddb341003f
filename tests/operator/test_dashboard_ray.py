"""The Ray dashboard client against a real local Ray (Jobs and State APIs)."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import pytest

from tests.operator.conftest import RayEndpoint
from tg_operator.dashboard import DashboardClient, DashboardUnreachable, JobInfo
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


def test_submit_is_idempotent_and_logs_are_read(ray_endpoint: RayEndpoint) -> None:
    sid = f"tgop-test-{uuid.uuid4().hex[:8]}"

    async def flow(d: DashboardClient) -> tuple[bool, bool, JobInfo | None, str, JobInfo | None]:
        assert (await d.version())["ray_version"]
        assert await d.get_job(sid) is None
        first = await d.submit_job(
            submission_id=sid, entrypoint=py("print(1)"), metadata={"trainergroup.io/uid": "x"}
        )
        again = await d.submit_job(submission_id=sid, entrypoint=py("print(2)"))
        job = await await_terminal(d, sid, timeout_s=300)
        logs = await d.job_logs(sid)
        assert await d.delete_job(sid)
        return first, again, job, logs, await d.get_job(sid)

    first, again, job, logs, after = run(ray_endpoint, flow)
    assert (first, again) == (True, False)
    assert job is not None and job.status == "SUCCEEDED", job
    assert job.metadata.get("trainergroup.io/uid") == "x"
    assert job.start_time_ms and job.driver_exit_code == 0
    assert "1" in logs.splitlines()
    assert after is None


def test_state_api_reports_a_killed_actor_with_its_cause(ray_endpoint: RayEndpoint) -> None:
    ns = f"tgop-test-{uuid.uuid4().hex[:8]}"
    create = (
        f"import ray; ray.init(namespace={ns!r})\n"
        "@ray.remote(num_cpus=0)\n"
        "class W:\n"
        "    def ping(self): return 1\n"
        "a = W.options(name='w0', lifetime='detached').remote(); ray.get(a.ping.remote())\n"
    )
    kill = f"import ray; ray.init(namespace={ns!r}); ray.kill(ray.get_actor('w0'))"

    async def flow(d: DashboardClient) -> tuple[list[str], list[tuple[str, str]]]:
        assert await d.list_actors(ray_namespace=ns) == []
        await d.submit_job(submission_id=f"{ns}-create", entrypoint=py(create))
        job = await await_terminal(d, f"{ns}-create", timeout_s=300)
        assert job is not None and job.status == "SUCCEEDED", await d.job_logs(f"{ns}-create")
        alive = [a.state for a in await d.list_actors(ray_namespace=ns)]
        await d.submit_job(submission_id=f"{ns}-kill", entrypoint=py(kill))
        job = await await_terminal(d, f"{ns}-kill", timeout_s=300)
        assert job is not None and job.status == "SUCCEEDED", await d.job_logs(f"{ns}-kill")
        for _ in range(40):
            dead = await d.list_actors(ray_namespace=ns)
            if dead and dead[0].state == "DEAD":
                break
            await asyncio.sleep(0.5)
        for sid in (f"{ns}-create", f"{ns}-kill"):
            await d.delete_job(sid)
        return alive, [(a.state, a.death_cause) for a in dead]

    alive, dead = run(ray_endpoint, flow)
    assert alive == ["ALIVE"]
    assert len(dead) == 1 and dead[0][0] == "DEAD"
    assert "ray.kill" in dead[0][1]


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
