"""Errors of the single-controller layer.

Every failure a caller can act on is one exception class, all under
``TrainerGroupError``. Each message names the group (and Ray namespace), the rank and
worker when one is involved, and the cause, so a log line alone says what broke.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tgapi.errors import PicklableError


class TrainerGroupError(PicklableError):
    """Base class of every error raised by ``tgruntime.controller``.

    Subclasses take keyword-only arguments; :class:`tgapi.errors.PicklableError` rebuilds
    them from their ``args`` and attributes (not by calling ``__init__``), so the errors
    survive pickling (e.g. raised inside a worker and re-raised by Ray).
    """


class GroupNotFoundError(TrainerGroupError):
    """No group (or no worker of that name) exists in the Ray namespace."""

    def __init__(
        self, *, group_name: str, ray_namespace: str, existing: Sequence[str] = (), detail: str = ""
    ) -> None:
        self.group_name = group_name
        self.ray_namespace = ray_namespace
        self.existing = list(existing)
        shown = ", ".join(sorted(self.existing)[:20]) if self.existing else "none"
        msg = (
            f"group {group_name!r} not found in Ray namespace {ray_namespace!r}"
            f" (groups in that namespace: {shown})"
        )
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class NamespaceMismatchError(TrainerGroupError):
    """The group (or worker) exists, but in another Ray namespace than the one asked for."""

    def __init__(
        self, *, group_name: str, ray_namespace: str, found_in: Sequence[str], detail: str = ""
    ) -> None:
        self.group_name = group_name
        self.ray_namespace = ray_namespace
        self.found_in = list(found_in)
        msg = (
            f"group {group_name!r} is not in Ray namespace {ray_namespace!r} but exists in "
            f"{', '.join(repr(n) for n in self.found_in)}; connect with that namespace"
        )
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class WorkerDiedError(TrainerGroupError):
    """A worker's actor is dead: a call to it can never complete."""

    def __init__(
        self, *, group_name: str, rank: int, worker_name: str, cause: str, method: str = ""
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.worker_name = worker_name
        self.cause = cause
        self.method = method
        during = f" during {method}()" if method else ""
        super().__init__(
            f"worker rank {rank} ({worker_name!r}) of group {group_name!r} died{during}: {cause}"
        )


class WorkerMethodError(TrainerGroupError):
    """A registered method raised on a worker; carries the remote traceback summary."""

    def __init__(
        self,
        *,
        group_name: str,
        rank: int,
        worker_name: str,
        method: str,
        error_type: str,
        summary: str,
        remote_traceback: str = "",
    ) -> None:
        self.group_name = group_name
        self.rank = rank
        self.worker_name = worker_name
        self.method = method
        self.error_type = error_type
        self.summary = summary
        self.remote_traceback = remote_traceback
        text = (
            f"{method}() raised {error_type} on rank {rank} ({worker_name!r}) of group "
            f"{group_name!r}: {summary}"
        )
        if remote_traceback:
            text += f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        super().__init__(text)


class PlacementTimeoutError(TrainerGroupError):
    """Placement groups were not placed in time: the cluster lacks the resources asked for."""

    def __init__(
        self,
        *,
        group_name: str,
        timeout_s: float,
        bundles: Sequence[Sequence[Mapping[str, float]]],
        strategy: str,
        available: Mapping[str, float],
        total: Mapping[str, float],
    ) -> None:
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.bundles = [list(b) for b in bundles]
        self.strategy = strategy
        self.available = dict(available)
        self.total = dict(total)
        asked = _sum_bundles(self.bundles)
        super().__init__(
            f"placement groups for group {group_name!r} not placed within {timeout_s:g}s: asked "
            f"{_fmt(asked)} as {sum(len(b) for b in self.bundles)} bundles in "
            f"{len(self.bundles)} placement group(s) ({strategy}, per group: "
            f"{[len(b) for b in self.bundles]} bundles of "
            f"{_fmt(self.bundles[0][0]) if self.bundles and self.bundles[0] else '{}'}); "
            f"cluster has {_fmt(_filter(self.total))} in total, {_fmt(_filter(self.available))} "
            "available"
        )


class PlacementInfeasibleError(TrainerGroupError):
    """The cluster's totals can never hold the group's bundles: fails before any waiting."""

    def __init__(
        self,
        *,
        group_name: str,
        bundles: Sequence[Sequence[Mapping[str, float]]],
        strategy: str,
        total: Mapping[str, float],
        reason: str,
        fix: str,
    ) -> None:
        self.group_name = group_name
        self.bundles = [list(b) for b in bundles]
        self.strategy = strategy
        self.total = dict(total)
        self.reason = reason
        self.fix = fix
        asked = _sum_bundles(self.bundles)
        count = sum(len(b) for b in self.bundles)
        first = self.bundles[0][0] if self.bundles and self.bundles[0] else {}
        # The cluster's totals of what was asked (plus CPU and GPU), 0 included: Ray omits zeros.
        shown = {k: float(self.total.get(k, 0.0)) for k in {*asked, "CPU", "GPU"}}
        super().__init__(
            f"group {group_name!r} can never be placed: asked {count} bundles of {_fmt(first)} "
            f"({_fmt(asked)} in all; {len(self.bundles)} placement group(s), {strategy}); "
            f"the cluster has {_fmt(shown)} in total: {reason}. Fix: {fix}"
        )


class ActorStartTimeoutError(TrainerGroupError):
    """Workers were created but did not become ready in time."""

    def __init__(self, *, group_name: str, timeout_s: float, pending: Sequence[str]) -> None:
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.pending = list(pending)
        super().__init__(
            f"{len(self.pending)} worker(s) of group {group_name!r} not ready within "
            f"{timeout_s:g}s: {', '.join(self.pending)}"
        )


class WorkerStartError(TrainerGroupError):
    """A worker's constructor raised (or its process died) while the group was being created."""

    def __init__(self, *, group_name: str, rank: int, worker_name: str, cause: str) -> None:
        self.group_name = group_name
        self.rank = rank
        self.worker_name = worker_name
        self.cause = cause
        super().__init__(
            f"worker rank {rank} ({worker_name!r}) of group {group_name!r} failed to start: {cause}"
        )


class GroupExistsError(TrainerGroupError):
    """A group of that name is already published in the Ray namespace."""

    def __init__(self, *, group_name: str, ray_namespace: str, generation: int) -> None:
        self.group_name = group_name
        self.ray_namespace = ray_namespace
        self.generation = generation
        super().__init__(
            f"group {group_name!r} (generation {generation}) already exists in Ray namespace "
            f"{ray_namespace!r}; attach to it or tear it down first"
        )


class CallTimeoutError(TrainerGroupError):
    """A group call did not finish within its timeout (workers are still running it)."""

    def __init__(
        self, *, group_name: str, method: str, timeout_s: float, pending: Sequence[str]
    ) -> None:
        self.group_name = group_name
        self.method = method
        self.timeout_s = timeout_s
        self.pending = list(pending)
        super().__init__(
            f"{method}() on group {group_name!r} not finished within {timeout_s:g}s; "
            f"still running on: {', '.join(self.pending)}"
        )


class RayConnectError(TrainerGroupError):
    """The driver could not connect to the Ray cluster; the message says what was tried."""


def _sum_bundles(bundles: Sequence[Sequence[Mapping[str, float]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for group in bundles:
        for bundle in group:
            for key, value in bundle.items():
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _filter(resources: Mapping[str, float]) -> dict[str, float]:
    """Keep the resources a person cares about (CPU, GPU, memory), not node: markers."""
    return {k: v for k, v in resources.items() if not k.startswith(("node:", "accelerator_type"))}


def _fmt(resources: Mapping[str, float]) -> str:
    parts = []
    for key in sorted(resources):
        value = float(resources[key])
        if key in ("memory", "object_store_memory"):
            parts.append(f"{key}={value / 2**30:.1f}GiB")
        else:
            parts.append(f"{key}={value:g}")
    return "{" + ", ".join(parts) + "}"
