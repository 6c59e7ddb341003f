"""The kopf handlers: thin wrappers around the reconcile, health and deletion flows.

Handlers are registered on an explicit registry by :func:`register` (so importing
this module has no side effects and the timer interval comes from the settings):

* startup: kopf settings (our finalizer, storage prefixes, watch timeouts,
  standalone peering, no cluster scanning), the shared :class:`Context`, metrics;
* create / update / resume: :func:`reconcile.drive`; a pending wait becomes
  :class:`kopf.TemporaryError` with the flow's delay;
* delete: :func:`deletion.finalize` (kopf adds and removes our finalizer);
* timer: :func:`health.check` every ``TG_HEALTH_INTERVAL_SECONDS``.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import kopf

from tg_operator import deletion, health, metrics, names, reconcile, storage
from tg_operator.context import Context
from tg_operator.events import KopfEvents
from tg_operator.kube import KubeApi, api_client
from tg_operator.settings import OperatorConfig

HANDLER_BUDGET_S = 20.0
"""How long a change handler keeps polling before it hands back to kopf with a delay."""

TG = (names.GROUP, names.VERSION, names.TG_PLURAL)


def configure_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.persistence.finalizer = names.FINALIZER
    # kopf's own storages, reading garbage in their annotations as absent (storage.py)
    settings.persistence.progress_storage = storage.TotalProgressStorage(
        prefix=names.STORAGE_PREFIX
    )
    settings.persistence.diffbase_storage = storage.TotalDiffBaseStorage(
        prefix=names.STORAGE_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = config.watch_timeout_s
    settings.watching.client_timeout = config.watch_timeout_s + 60
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    settings.peering.standalone = True
    settings.scanning.disabled = True
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "trainergroup-operator"


def _ctx(memo: Any) -> Context:
    ctx = memo.get("ctx") if hasattr(memo, "get") else None
    if not isinstance(ctx, Context):
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return ctx


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler on ``registry``."""

    @kopf.on.login(registry=registry, id="login")
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry, id="startup")
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings, config)
        memo["ctx"] = Context(
            config=config,
            kube=KubeApi(api_client()),
            session=aiohttp.ClientSession(),
        )
        metrics.serve(config.metrics_port)

    @kopf.on.cleanup(registry=registry, id="cleanup")
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        ctx = memo.get("ctx")
        if isinstance(ctx, Context):
            await ctx.close()

    @kopf.on.resume(*TG, registry=registry, id=names.RECONCILE_HANDLER)
    @kopf.on.create(*TG, registry=registry, id=names.RECONCILE_HANDLER)
    @kopf.on.update(*TG, registry=registry, id=names.RECONCILE_HANDLER)
    async def reconcile_trainergroup(
        name: str, namespace: str | None, body: kopf.Body, memo: Any, reason: str, **_: Any
    ) -> None:
        step = await reconcile.drive(
            _ctx(memo),
            namespace=str(namespace),
            name=name,
            sink=KopfEvents(body),
            trigger=str(reason),
            budget_s=HANDLER_BUDGET_S,
        )
        if not step.done:
            raise kopf.TemporaryError(step.message, delay=max(step.delay, 1.0))

    @kopf.on.delete(*TG, registry=registry, id="cleanup-ray")
    async def delete_trainergroup(body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
        await deletion.finalize(_ctx(memo), body=body, sink=KopfEvents(body), retry=retry)

    @kopf.timer(
        *TG,
        registry=registry,
        id="health",
        interval=config.health_interval_s,
        initial_delay=config.health_interval_s,
    )
    async def health_check(
        name: str,
        namespace: str | None,
        body: kopf.Body,
        status: kopf.Status,
        annotations: kopf.Annotations,
        memo: Any,
        **_: Any,
    ) -> None:
        await health.check(
            _ctx(memo),
            namespace=str(namespace),
            name=name,
            phase=str(status.get("phase", "")),
            annotations=annotations,
            sink=KopfEvents(body),
        )
