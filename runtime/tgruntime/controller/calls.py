"""Waiting for worker results and turning Ray's errors into the group's errors.

``resolve`` is the one place a group call blocks. It returns as soon as any worker's
result is an error (Ray's ``get`` aborts early on an error object), so a dead worker is
reported at once instead of after its peers finish (or hang in a collective).

When one rank's error is delivered, the other ranks' results are marked retrieved
(:func:`mark_retrieved`): otherwise Ray logs an "Unhandled error" block on the driver for
each other rank whose error object is freed unread, a copy of the traceback the caller
already got (often the same error on every rank).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from tgruntime.controller.errors import CallTimeoutError, WorkerDiedError, WorkerMethodError


@dataclass(frozen=True)
class CallContext:
    """Who a list of result references came from: enough to name the failing worker."""

    group_name: str
    method: str
    ranks: tuple[int, ...]
    worker_names: tuple[str, ...]
    actor_ids: tuple[str, ...]


def resolve(refs: Sequence[Any], ctx: CallContext, *, timeout_s: float | None = None) -> list[Any]:
    """``ray.get`` the references, raising WorkerDiedError / WorkerMethodError /
    CallTimeoutError."""
    refs = list(refs)
    try:
        return list(ray.get(refs, timeout=timeout_s))
    except GetTimeoutError:
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
        pending_set = set(pending)
        names = [
            f"rank {r} ({n})"
            for ref, r, n in zip(refs, ctx.ranks, ctx.worker_names, strict=True)
            if ref in pending_set
        ]
        raise CallTimeoutError(
            group_name=ctx.group_name,
            method=ctx.method,
            timeout_s=float(timeout_s or 0),
            pending=names,
        ) from None
    except RayError as exc:
        error = translate(exc, refs, ctx)
        if isinstance(error, WorkerMethodError):  # the root cause may be a peer's death
            error = died_peer(refs, ctx) or error
        mark_retrieved(refs)
        raise error from exc


DIED_PEER_GRACE_S = 5.0


def died_peer(
    refs: Sequence[Any], ctx: CallContext, *, grace_s: float = DIED_PEER_GRACE_S
) -> WorkerDiedError | None:
    """A rank's death among ``refs``, waited for up to ``grace_s``.

    When a worker is killed mid-call, its peers blocked in a collective usually raise first
    (gloo's "Connection reset by peer", NCCL's abort), naming a rank that is alive. The dead
    rank's own result arrives a moment later; reporting it names the cause. Waits only
    while results are missing, so a method error raised on every rank costs nothing."""
    for i, exc in _ready_errors(refs, timeout_s=grace_s):
        if isinstance(exc, RayTaskError) and isinstance(exc.cause, RayActorError):
            exc = exc.cause
        if isinstance(exc, RayActorError):
            return WorkerDiedError(
                group_name=ctx.group_name, rank=ctx.ranks[i], worker_name=ctx.worker_names[i],
                cause=actor_error_cause(exc), method=ctx.method,
            )
    return None


def _ready_errors(refs: Sequence[Any], *, timeout_s: float) -> list[tuple[int, BaseException]]:
    """(index, error) of each result in ``refs`` that is ready within ``timeout_s`` and is an
    error, in order; never raises."""
    try:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    except Exception:
        return []
    ready_set = set(ready)
    out: list[tuple[int, BaseException]] = []
    for i, ref in enumerate(refs):
        if ref not in ready_set:
            continue
        try:
            ray.get(ref, timeout=0)
        except Exception as exc:
            out.append((i, exc))
    return out


def mark_retrieved(refs: Sequence[Any]) -> None:
    """Make Ray count every result in ``refs`` as retrieved, without ever blocking.

    Ray reports an error object freed before anyone fetched it as "Unhandled error" on the
    driver's stderr. After one rank's error is delivered, the finished results are fetched
    here (errors ignored); the ones still running get a completion callback
    (``ObjectRef.future()``), which fetches them when they finish, so a hung rank costs
    nothing and a late error is not reported either. Never raises.
    """
    try:
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    except Exception:
        ready, pending = [], list(refs)
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
        except GetTimeoutError:  # ready but not fetchable at once: let a callback fetch it
            pending.append(ref)
        except Exception:
            pass
    for ref in pending:
        with contextlib.suppress(Exception):
            ref.future()


def translate(exc: BaseException, refs: Sequence[Any], ctx: CallContext) -> BaseException:
    """The group error for a Ray error raised while getting ``refs`` (or ``exc`` itself)."""
    index = _failed_index(exc, refs, ctx)
    rank = ctx.ranks[index] if index is not None else -1
    name = ctx.worker_names[index] if index is not None else "?"
    if isinstance(exc, RayActorError):
        return WorkerDiedError(
            group_name=ctx.group_name, rank=rank, worker_name=name, cause=actor_error_cause(exc),
            method=ctx.method,
        )
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, RayActorError):
            return WorkerDiedError(
                group_name=ctx.group_name, rank=rank, worker_name=name,
                cause=actor_error_cause(cause), method=ctx.method,
            )
        error_type = type(cause).__name__ if cause is not None else "Exception"
        summary = str(cause) if cause is not None else _strip_ansi(str(exc))
        return WorkerMethodError(
            group_name=ctx.group_name,
            rank=rank,
            worker_name=name,
            method=ctx.method,
            error_type=error_type,
            summary=summary.strip().splitlines()[0] if summary.strip() else error_type,
            remote_traceback=_short_traceback(_remote_traceback(exc)),
        )
    return exc


def actor_error_cause(exc: RayActorError) -> str:
    """One or two readable lines out of Ray's multi-line actor-death message."""
    text = str(exc.error_msg if getattr(exc, "error_msg", None) else exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [
        ln for ln in lines
        if not ln.startswith(("class_name:", "actor_id:", "namespace:", "ip:", "name:"))
        and ln != RayActorError.BASE_ERROR_MSG
    ]
    return " ".join(keep[:3]) or (lines[0] if lines else "actor died")


def _failed_index(exc: BaseException, refs: Sequence[Any], ctx: CallContext) -> int | None:
    actor_id = getattr(exc, "actor_id", None) or getattr(
        getattr(exc, "cause", None), "actor_id", None
    )
    if actor_id is None and isinstance(exc, RayTaskError):
        actor_id = getattr(exc, "_actor_id", None)
    if isinstance(actor_id, str) and actor_id in ctx.actor_ids:
        return ctx.actor_ids.index(actor_id)
    failed = _ready_errors(refs, timeout_s=0)
    return failed[0][0] if failed else None


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _remote_traceback(exc: RayTaskError) -> str:
    """The worker-side traceback Ray formatted into the error (attribute names vary by version)."""
    text = getattr(exc, "traceback_str", None)
    if not text:
        args = getattr(exc, "_ray_task_error_args", None)
        if isinstance(args, tuple | list) and len(args) > 1 and isinstance(args[1], str):
            text = args[1]
    return _strip_ansi(text or str(exc))


def _short_traceback(text: str, max_lines: int = 30) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) <= max_lines:
        return "\n".join(lines)
    return "\n".join(["...", *lines[-max_lines:]])
