"""What every flow needs: settings, the Kubernetes API, dashboard clients, locks.

One :class:`Context` lives for the operator's lifetime (made in the startup
handler, closed in the cleanup handler). Flows for one TrainerGroup serialise on
its lock, because kopf runs a timer concurrently with the change handlers.
"""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from tg_operator import errors, ray_token
from tg_operator.dashboard import DashboardClient
from tg_operator.job_slots import JobSlots
from tg_operator.kube import KubeApi
from tg_operator.metrics import PhaseTracker
from tg_operator.settings import OperatorConfig
from tgapi import TrainerGroup


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
    tokens: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    """Each group's Ray token by uid (read from its Secret once)."""

    def __post_init__(self) -> None:
        self.slots.limit = self.config.max_concurrent_jobs

    def dashboard(self, url: str, *, token: str | None = None) -> DashboardClient:
        return DashboardClient(
            base_url=url,
            session=self.session,
            timeout_s=self.config.dashboard_timeout_s,
            token=self.config.ray_auth_token if token is None else token,
        )

    async def group_dashboard(self, tg: TrainerGroup, url: str) -> DashboardClient:
        """The dashboard client of ``tg``'s cluster, with the group's token when it has one."""
        return self.dashboard(url, token=await self.group_token(tg))

    async def group_token(self, tg: TrainerGroup) -> str | None:
        """The group's Ray token (None: the operator's own, for rayClusterRef or auth off).

        Derived from the operator's key (``ray_token.derive_token``), so the operator never
        reads a Secret; the first call per group creates the group's Secret when absent.
        """
        if not ray_token.uses_token(tg):
            return None
        cached = self.tokens.get(tg.uid)
        if cached:
            return cached
        token = self.config.ray_auth_token or (
            ray_token.derive_token(key=self.config.ray_token_key, uid=tg.uid)
            if self.config.ray_token_key
            else ""
        )
        if not token:
            raise errors.TokenSecretInvalid(
                "the operator has no TG_RAY_TOKEN_KEY (the Helm chart sets it from its Secret) "
                "to make this group's Ray token: set it, or set spec.rayCluster.auth: disabled"
            )
        await self.kube.create_secret(ray_token.build_secret(tg, token=token))
        self.tokens[tg.uid] = token
        return token

    def lock(self, *, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault(f"{namespace}/{name}", asyncio.Lock())

    def forget(self, *, namespace: str, name: str, uid: str) -> None:
        self.locks.pop(f"{namespace}/{name}", None)
        self.tokens.pop(uid, None)
        self.phases.forget(uid)

    async def close(self) -> None:
        await self.session.close()
        self.kube.close()
