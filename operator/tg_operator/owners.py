"""Ownership: the one owner reference the operator puts on what it makes, and the check that an
object carries it. A module of its own so that every builder (raycluster, ray_token,
networkpolicy, tinker) uses it without importing another builder."""

from __future__ import annotations

from typing import Any

from tg_operator import names
from tgapi import TrainerGroup


def owner_reference(tg: TrainerGroup) -> dict[str, Any]:
    """The one owner reference (``controller: true``) of everything the operator makes for
    ``tg``: the RayCluster, the Ray token Secret, the NetworkPolicies, the Tinker objects.
    Garbage collection removes them with the TrainerGroup."""
    return {
        "apiVersion": names.TG_API_VERSION,
        "kind": names.TG_KIND,
        "name": tg.name,
        "uid": tg.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_owned_by(raycluster: dict[str, Any], tg: TrainerGroup) -> bool:
    refs = raycluster.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == tg.uid for r in refs)
