"""What every flow needs: settings, the Kubernetes API, dashboard clients, locks, wake-ups.

One :class:`Context` lives for the operator's lifetime (made in the startup
handler, closed in the cleanup handler). Flows for one TrainerGroup serialise on
its lock. Each group's loop (:mod:`tg_operator.group_loop`) sleeps on its wake-up
event; the watches on RayClusters and pods set it (:meth:`Context.wake_cluster`),
and so do spec changes. The last status the operator wrote for an object is kept
here (only the operator writes it), so a pass needs no GET of the TrainerGroup.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Callable

from tg_operator import errors, ray_token
from tg_operator.job_slots import JobSlots
from tg_operator.metrics import PhaseTracker
from tg_operator.ports import Dashboard, KubeApi
from tg_operator.settings import OperatorConfig
from tgapi import TrainerGroup, TrainerGroupStatus


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """The result of one pass: settled, or look again after ``delay`` seconds (or on a wake)."""

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
    dashboards: Callable[[str, str], Dashboard]
    """A client for the Ray dashboard at a URL, sending a token ("" for none)."""
    clock: Callable[[], datetime.datetime] = utcnow
    phases: PhaseTracker = dataclasses.field(default_factory=PhaseTracker)
    locks: dict[str, asyncio.Lock] = dataclasses.field(default_factory=dict)
    slots: JobSlots = dataclasses.field(default_factory=lambda: JobSlots(limit=0))
    written: dict[str, tuple[TrainerGroupStatus, str]] = dataclasses.field(default_factory=dict)
    """The last status written and the resourceVersion it made, by object uid."""
    wakers: dict[str, asyncio.Event] = dataclasses.field(default_factory=dict)
    cluster_users: dict[tuple[str, str], set[str]] = dataclasses.field(default_factory=dict)
    """(namespace, RayCluster) -> the keys of the groups running on it."""
    looping: set[str] = dataclasses.field(default_factory=set)
    """Uids whose group loop runs in this process (it also does their cleanup)."""
    cleaned: set[str] = dataclasses.field(default_factory=set)
    """Uids whose cleanup finished in this process (the delete handler has nothing to do)."""
    closers: list[Callable[[], object]] = dataclasses.field(default_factory=list)
    tinker_created: dict[str, datetime.datetime] = dataclasses.field(default_factory=dict)
    """When this process created each group's Tinker server objects, by uid (until the
    Deployment watch shows the Deployment: snapshot.TinkerSeen.just_created)."""
    tokens: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    """Each group's Ray token by uid (read from its Secret once)."""

    def __post_init__(self) -> None:
        self.slots.limit = self.config.max_concurrent_jobs
        self.slots.on_free = lambda key: self.wakers.setdefault(key, asyncio.Event()).set()

    def dashboard(self, url: str, *, token: str | None = None) -> Dashboard:
        """A client for the dashboard at ``url`` (``token``: the group's; default the
        operator's own, ``TG_RAY_AUTH_TOKEN``)."""
        return self.dashboards(url, self.config.ray_auth_token if token is None else token)

    async def group_dashboard(self, tg: TrainerGroup, url: str) -> Dashboard:
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

    def waker(self, *, namespace: str, name: str) -> asyncio.Event:
        return self.wakers.setdefault(f"{namespace}/{name}", asyncio.Event())

    def wake(self, *, namespace: str, name: str) -> None:
        self.waker(namespace=namespace, name=name).set()

    def use_cluster(self, *, namespace: str, cluster: str, name: str) -> None:
        self.cluster_users.setdefault((namespace, cluster), set()).add(name)

    def wake_cluster(self, *, namespace: str, cluster: str) -> None:
        """A RayCluster or one of its pods changed: wake every group on it."""
        for name in self.cluster_users.get((namespace, cluster), ()):
            self.wake(namespace=namespace, name=name)

    def forget(self, *, namespace: str, name: str, uid: str) -> None:
        self.locks.pop(f"{namespace}/{name}", None)
        self.wakers.pop(f"{namespace}/{name}", None)
        for (ns, _), users in self.cluster_users.items():
            if ns == namespace:
                users.discard(name)
        self.written.pop(uid, None)
        self.tokens.pop(uid, None)
        self.phases.forget(uid)

    async def close(self) -> None:
        for close in self.closers:
            result = close()
            if asyncio.iscoroutine(result):
                await result
