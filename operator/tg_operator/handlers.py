"""The kopf handlers: thin wrappers that start each group's loop and wake it.

Handlers are registered on an explicit registry by :func:`register` (so importing
this module has no side effects):

* startup: kopf settings (our finalizer, storage prefixes, watch timeouts,
  standalone peering, no cluster scanning), the shared :class:`Context`, metrics;
* a daemon per TrainerGroup, :func:`group_loop.run`: every reconcile pass, the
  health checks and the cleanup on deletion run there, never in a change handler;
* create / update (spec) / resume: wake the group's loop (they never wait);
* indexes of RayClusters and of the pods KubeRay labels ``ray.io/cluster``, and
  event handlers on both that wake the groups running on that cluster;
* an index of the Tinker servers' Deployments (label ``trainergroup.io/tinker``) and an
  event handler that wakes their group (``status.apiURL`` follows availability);
* an index of every TrainerGroup's Tinker URL and model names, and an event handler that
  keeps the namespace's (or the cluster's) Tinker gateway in step (tg_operator.gateway);
* delete: keeps kopf's finalizer on the object; the loop does the cleanup. Only
  for an object already being deleted when this process started (no loop ran for
  it) does the handler clean up itself, one step per retry.
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import kopf

from tg_operator import (
    deletion,
    gateway,
    gateway_sync,
    group_loop,
    metrics,
    names,
    storage,
    tinker,
    watched,
)
from tg_operator.context import Context
from tg_operator.dashboard import DashboardClient
from tg_operator.events import KopfEvents
from tg_operator.kube import KubeApi, api_client
from tg_operator.settings import OperatorConfig

DELETION_POLL_S = 2.0
TG = (names.GROUP, names.VERSION, names.TG_PLURAL)
RAYCLUSTERS = (names.RAY_GROUP, names.RAY_VERSION, names.RAY_PLURAL)
PODS = ("", "v1", "pods")
POD_FILTER = {names.RAY_CLUSTER_LABEL: kopf.PRESENT}
DEPLOYMENTS = ("apps", "v1", "deployments")
TINKER_FILTER = {tinker.SERVER_LABEL: kopf.PRESENT}
TINKER_INDEX = "tinker_index"
CLUSTER_INDEX = "rayclusters_index"
POD_INDEX = "raypods_index"
GATEWAY_INDEX = "gateway_index"


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
    # A deleted object's finalizer goes once its loop has cleaned up and exited; kopf
    # looks whether the loop is done this often (its default is 60 s).
    settings.background.cancellation_polling = DELETION_POLL_S
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "trainergroup-operator"


def _ctx(memo: Any) -> Context:
    ctx = memo.get("ctx") if hasattr(memo, "get") else None
    if not isinstance(ctx, Context):
        raise kopf.TemporaryError("the operator is still starting", delay=1)
    return ctx


def make_context(config: OperatorConfig) -> Context:
    """The operator's context: the Kubernetes client, one aiohttp session for Ray."""
    api = KubeApi(api_client())
    session = aiohttp.ClientSession()

    def dashboard(url: str, token: str) -> DashboardClient:
        return DashboardClient(
            base_url=url, session=session, timeout_s=config.dashboard_timeout_s, token=token
        )

    ctx = Context(config=config, kube=api, dashboards=dashboard)
    ctx.closers.extend([session.close, api.close])
    return ctx


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler on ``registry``."""

    @kopf.on.login(registry=registry, id="login")
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry, id="startup")
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure_settings(settings, config)
        memo["ctx"] = make_context(config)
        memo["base_kube"] = memo["ctx"].kube
        metrics.serve(config.metrics_port)

    @kopf.on.cleanup(registry=registry, id="cleanup")
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        ctx = memo.get("ctx")
        if isinstance(ctx, Context):
            await ctx.close()

    # -- what the operator watches besides TrainerGroups ----------------------------------
    @kopf.index(*RAYCLUSTERS, registry=registry, id=CLUSTER_INDEX)
    def rayclusters_index(
        namespace: str | None, name: str, body: kopf.Body, **_: Any
    ) -> dict[Any, Any]:
        return watched.cluster_entry(namespace=str(namespace), name=name, body=body)

    @kopf.index(*PODS, labels=POD_FILTER, registry=registry, id=POD_INDEX)
    def raypods_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return watched.pod_entry(namespace=str(namespace), body=body)

    @kopf.index(*DEPLOYMENTS, labels=TINKER_FILTER, registry=registry, id=TINKER_INDEX)
    def tinker_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return tinker.deployment_entry(namespace=str(namespace), body=body)

    @kopf.on.event(*DEPLOYMENTS, labels=TINKER_FILTER, registry=registry, id="tinker-changed")
    def tinker_changed(namespace: str | None, labels: kopf.Labels, memo: Any, **_: Any) -> None:
        ctx = memo.get("ctx")
        if isinstance(ctx, Context):
            ctx.wake(namespace=str(namespace), name=str(labels.get(tinker.SERVER_LABEL)))

    @kopf.on.event(*RAYCLUSTERS, registry=registry, id="raycluster-changed")
    def raycluster_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
        ctx = memo.get("ctx")
        if isinstance(ctx, Context):
            ctx.wake_cluster(namespace=str(namespace), cluster=name)

    @kopf.on.event(*PODS, labels=POD_FILTER, registry=registry, id="raypod-changed")
    def raypod_changed(
        namespace: str | None, labels: kopf.Labels, memo: Any, **_: Any
    ) -> None:
        ctx = memo.get("ctx")
        if isinstance(ctx, Context):
            ctx.wake_cluster(
                namespace=str(namespace), cluster=str(labels.get(names.RAY_CLUSTER_LABEL))
            )

    # -- the Tinker gateway: every group's URL and model names (tg_operator.gateway) ------
    @kopf.index(*TG, registry=registry, id=GATEWAY_INDEX)
    def gateway_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        key = gateway_sync.index_key(mode=config.gateway, namespace=str(namespace))
        entry = gateway.group_entry(body) if key is not None else None
        return {} if entry is None else {key: entry}

    @kopf.on.event(*TG, registry=registry, id="gateway-sync")
    async def gateway_changed(namespace: str | None, memo: Any, **kwargs: Any) -> None:
        key = gateway_sync.index_key(mode=config.gateway, namespace=str(namespace))
        kube = memo.get("base_kube") if hasattr(memo, "get") else None
        if key is None or kube is None:
            return
        index = kwargs[GATEWAY_INDEX]
        entries = list(index.get(key, ())) if key in index else []
        done = memo.setdefault("gateway_done", {})
        where = key or config.operator_namespace
        if not where:
            return  # cluster mode needs the operator's namespace (TG_OPERATOR_NAMESPACE)
        try:
            await gateway_sync.sync(
                kube, namespace=where, entries=entries, cluster=config.gateway == "cluster",
                image=config.gateway_image, python=config.python, done=done,
            )
        except Exception as exc:  # the next TrainerGroup event tries again
            logging.getLogger("tg_operator.gateway").warning(
                "tinker gateway in %s not synced: %s", where, exc
            )

    # -- TrainerGroups ----------------------------------------------------------------
    @kopf.daemon(*TG, registry=registry, id="group-loop", cancellation_timeout=None)
    async def group_daemon(
        body: kopf.Body, memo: Any, stopped: kopf.DaemonStopped, logger: Any, **kwargs: Any
    ) -> None:
        # Returns nothing: kopf would store a handler's result in the object's status.
        ctx = _ctx(memo)
        if not isinstance(ctx.kube, watched.WatchedKube):
            ctx.kube = watched.WatchedKube(
                api=memo["base_kube"],
                clusters=kwargs[CLUSTER_INDEX],
                pods=kwargs[POD_INDEX],
                tinker=kwargs[TINKER_INDEX],
            )
        done = await group_loop.run(ctx, body=body, stopped=stopped, sink=KopfEvents(body))
        logger.info("group loop exited: %s", done)

    @kopf.on.resume(*TG, registry=registry, id=names.RECONCILE_HANDLER)
    @kopf.on.create(*TG, registry=registry, id=names.RECONCILE_HANDLER)
    @kopf.on.update(*TG, field="spec", registry=registry, id=names.RECONCILE_HANDLER)
    def wake_group(name: str, namespace: str | None, memo: Any, **_: Any) -> None:
        _ctx(memo).wake(namespace=str(namespace), name=name)

    @kopf.on.delete(*TG, registry=registry, id="cleanup-ray")
    async def delete_trainergroup(
        body: kopf.Body, memo: Any, retry: int, uid: str, **_: Any
    ) -> None:
        ctx = _ctx(memo)
        if uid in ctx.looping or uid in ctx.cleaned:
            return  # the group's loop cleans up; kopf keeps the finalizer until it exits
        step = await deletion.finalize_step(ctx, body=body, sink=KopfEvents(body), attempt=retry)
        if not step.done:
            raise kopf.TemporaryError(step.message, delay=step.delay)
