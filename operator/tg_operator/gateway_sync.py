"""Keeps the Tinker gateway's objects (tg_operator.gateway builds them) in step with the
TrainerGroups: on every TrainerGroup event the handler passes the namespace's entries (a kopf
index of :func:`tg_operator.gateway.group_entry`); this creates the gateway once an image is
known, merges the groups into its Deployment's owners when they change, and creates its other
objects once."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tg_operator import gateway

log = logging.getLogger("tg_operator.gateway")


class GatewayKube(Protocol):
    async def apply_owned_deployment(self, body: dict[str, Any]) -> str: ...

    async def create_object(self, body: dict[str, Any]) -> bool: ...

    async def scale_deployment(self, namespace: str, name: str, replicas: int) -> None: ...


def index_key(*, mode: str, namespace: str) -> str | None:
    """The gateway an event's namespace feeds: its own (namespace mode), the one of the
    operator's namespace (``""`` here, cluster mode), or none (off)."""
    if mode == "off":
        return None
    return "" if mode == "cluster" else namespace


async def sync(
    kube: GatewayKube, *, namespace: str, entries: Sequence[Mapping[str, Any]], cluster: bool,
    image: str, python: str, done: dict[str, str],
) -> bool:
    """Create (or re-own) the namespace's gateway when its groups or image differ from the
    last pass (``done``: namespace -> what was applied). True when something was applied. A
    namespace without groups keeps what it had: the garbage collector removes a namespace's
    gateway with its last TrainerGroup."""
    if not entries:
        return False
    chosen = gateway.image_of(entries, image)
    if not chosen:
        log.warning("tinker gateway in %s: no image yet (set gateway.image)", namespace)
        return False
    dep = gateway.build_deployment(
        namespace, entries, image=chosen, python=python, cluster=cluster
    )
    spaces = sorted({str(e["namespace"]) for e in entries})
    stamp = json.dumps([dep["metadata"].get("ownerReferences"), chosen, cluster, spaces])
    if done.get(namespace) == stamp:
        return False
    # Created with no pods: its ServiceAccount, Role and RoleBinding are owned by it, so they
    # come after it, and a ReplicaSet that ran first failed its pods ('serviceaccount
    # "tinker-gateway" not found' warnings, the kind suite's gateway phase); scaled up once
    # they exist. An existing Deployment only gets the owners merged (replicas untouched).
    first = {**dep, "spec": {**dep["spec"], "replicas": 0}}
    uid = await kube.apply_owned_deployment(first)
    for body in gateway.objects(namespace, uid, cluster=cluster):
        await kube.create_object(body)
    if cluster:  # each group namespace admits the gateway's (their policies: their own)
        for ns in [n for n in spaces if n != namespace]:
            await kube.create_object(gateway.build_cross_namespace_ingress(ns, namespace))
    await kube.scale_deployment(namespace, gateway.NAME, int(dep["spec"]["replicas"]))
    done[namespace] = stamp
    return True
