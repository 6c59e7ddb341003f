"""Keeps the Tinker gateway's objects (tg_operator.gateway builds them) in step with the
TrainerGroups: on every TrainerGroup event the handler passes the namespace's entries (a kopf
index of :func:`tg_operator.gateway.group_entry`) and this writes the group list when it
changed, and creates the gateway's other objects once."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tg_operator import gateway

log = logging.getLogger("tg_operator.gateway")


class GatewayKube(Protocol):
    async def apply_configmap(self, body: dict[str, Any]) -> str: ...

    async def create_object(self, body: dict[str, Any]) -> bool: ...


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
    """Write the namespace's group list when it differs from the last one written (``done``:
    namespace -> what was written), then create the gateway once an image is known. True when
    something was written. A namespace without groups keeps what it had: the garbage
    collector removes a namespace's gateway with its last TrainerGroup."""
    if not entries and not cluster:
        return False
    cm = gateway.build_configmap(namespace, list(entries), cluster=cluster)
    chosen = gateway.image_of(list(entries), image)
    stamp = json.dumps([cm, chosen], sort_keys=True)
    if done.get(namespace) == stamp:
        return False
    uid = await kube.apply_configmap(cm)
    if chosen:
        for body in gateway.objects(namespace, uid, image=chosen, python=python, cluster=cluster):
            await kube.create_object(body)
        if cluster:  # each group namespace admits the gateway's (their policies: their own)
            for ns in sorted({str(e["namespace"]) for e in entries} - {namespace}):
                await kube.create_object(gateway.build_cross_namespace_ingress(ns, namespace))
    else:
        log.warning("tinker gateway in %s: no image yet (set gateway.image)", namespace)
    done[namespace] = stamp
    return True
