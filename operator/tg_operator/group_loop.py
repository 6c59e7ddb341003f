"""One loop per TrainerGroup (a kopf daemon): reconcile, sleep until woken, repeat.

Each pass (:func:`tg_operator.reconcile.advance`) returns how soon it wants to look
again; the loop then sleeps on the group's wake-up event with that timeout. The
watches on the group's RayCluster and pods, and spec changes, set the event, so
the loop reacts to Kubernetes at once and polls only what has no watch: a running
Ray job (every second while it runs), a waiting back-off, and the workers' health
every ``TG_HEALTH_INTERVAL_SECONDS`` once the group is settled. The loops of
different groups are separate asyncio tasks: a slow dashboard holds only its own.

When the object is deleted, kopf signals the loop to stop and keeps the finalizer
until it exits; the loop then runs the cleanup (:func:`deletion.finalize_step`)
until it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Mapping
from typing import Any, Protocol

import kopf

from tg_operator import backoff, deletion, metrics, names, reconcile
from tg_operator.context import Context, Step
from tg_operator.events import EventSink

log = logging.getLogger(__name__)

FAILED_RECHECK_S = 300.0
"""A settled Failed group waits for a spec change; this is only a safety net."""


class Stopped(Protocol):
    """kopf's ``stopped`` flag of a daemon (``kopf.DaemonStopped``)."""

    def __bool__(self) -> bool: ...

    @property
    def reason(self) -> Any: ...

    def wait(self, timeout: float | None = None) -> Awaitable[Any]: ...


async def sleep(wake: asyncio.Event, stopped: Stopped, *, timeout: float) -> None:
    """Until ``wake`` is set, ``stopped`` is set, or ``timeout`` seconds pass."""
    if wake.is_set() or stopped or timeout <= 0:
        return
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def next_sleep(step: Step, *, phase: str, health_interval_s: float) -> float:
    if not step.done:
        return step.delay
    return FAILED_RECHECK_S if phase == "Failed" else health_interval_s


def being_deleted(stopped: Stopped) -> bool:
    reason = stopped.reason
    return reason is not None and bool(reason & kopf.DaemonStoppingReason.RESOURCE_DELETED)


async def run(
    ctx: Context, *, body: Mapping[str, Any], stopped: Stopped, sink: EventSink
) -> str:
    """The daemon's body. ``body`` is kopf's live view of the object."""
    meta = body.get("metadata", {})
    namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
    wake = ctx.waker(namespace=namespace, name=name)
    ctx.looping.add(uid)
    try:
        while not stopped:
            wake.clear()
            step = await _pass(ctx, body=body, sink=sink)
            phase = reconcile.current_status(ctx, body).phase
            delay = next_sleep(step, phase=phase, health_interval_s=ctx.config.health_interval_s)
            await sleep(wake, stopped, timeout=delay)
        if not being_deleted(stopped):
            return "the operator is stopping"
        attempt = 0
        while True:
            wake.clear()
            step = await deletion.finalize_step(ctx, body=body, sink=sink, attempt=attempt)
            if step.done:
                ctx.cleaned.add(uid)
                await _release(ctx, body=body)
                return step.message
            attempt += 1
            await _sleep_only(wake, timeout=step.delay)
    finally:
        ctx.looping.discard(uid)


async def _pass(ctx: Context, *, body: Mapping[str, Any], sink: EventSink) -> Step:
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        step = await reconcile.advance(ctx, obj=body, sink=sink)
    except Exception as exc:  # a Kubernetes API or programming error: keep the loop alive
        metrics.RECONCILES.labels(trigger="loop", result="error").inc()
        log.error("reconcile of %s failed: %s", _key(body), exc, exc_info=True)
        return Step.wait(backoff.ERROR_RETRY_S, f"reconcile error: {exc}")
    finally:
        metrics.RECONCILE_SECONDS.labels(trigger="loop").observe(loop.time() - started)
    metrics.RECONCILES.labels(trigger="loop", result="done" if step.done else "wait").inc()
    return step


async def _release(ctx: Context, *, body: Mapping[str, Any]) -> None:
    """Drop our finalizer: kopf would only notice the loop's exit at its next poll."""
    meta = body.get("metadata", {})
    finalizers = [str(f) for f in meta.get("finalizers") or []]
    try:
        await ctx.kube.remove_finalizer(
            namespace=str(meta.get("namespace")),
            name=str(meta.get("name")),
            finalizers=finalizers,
            finalizer=names.FINALIZER,
        )
    except Exception as exc:  # kopf removes it anyway once it sees the loop gone
        log.warning("%s: could not remove the finalizer: %s", _key(body), exc)


async def _sleep_only(wake: asyncio.Event, *, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), timeout=timeout)


def _key(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata", {})
    return f"{meta.get('namespace')}/{meta.get('name')}"
