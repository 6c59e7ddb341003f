"""What every flow needs: settings, the Kubernetes API, dashboard clients, locks.

One :class:`Context` lives for the operator's lifetime (made in the startup
handler, closed in the cleanup handler). Flows for one TrainerGroup serialise on
its lock, because kopf runs a timer concurrently with the change handlers.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from tg_operator.dashboard import DashboardClient
from tg_operator.job_slots import JobSlots
from tg_operator.kube import KubeApi
from tg_operator.metrics import PhaseTracker
from tg_operator.settings import OperatorConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """The result of one reconcile pass: settled, or look again after ``delay`` seconds."""

    done: bool
    delay: float = 0.0
    message: str = ""

    @classmethod
    def settled(cls, message: str = "") -> Step:
        return cls(done=True, message=message)

    @classmethod
    def wait(cls, delay: float, message: str) -> Step:
        return cls(done=False, delay=delay, message=message)


@dataclasses.dataclass(kw_only=True)
class Context:
    config: OperatorConfig
    kube: KubeApi
    session: aiohttp.ClientSession
    phases: PhaseTracker = dataclasses.field(default_factory=PhaseTracker)
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    slots: JobSlots = dataclasses.field(default_factory=lambda: JobSlots(limit=0))

    def __post_init__(self) -> None:
        self.slots.limit = self.config.max_concurrent_jobs

    def dashboard(self, url: str) -> DashboardClient:
        return DashboardClient(
            base_url=url,
            session=self.session,
            timeout_s=self.config.dashboard_timeout_s,
            token=self.config.ray_auth_token,
        )

    def lock(self, *, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault(f"{namespace}/{name}", asyncio.Lock())

    def forget(self, *, namespace: str, name: str, uid: str) -> None:
        self.locks.pop(f"{namespace}/{name}", None)
        self.phases.forget(uid)

    async def close(self) -> None:
        await self.session.close()
        self.kube.close()
