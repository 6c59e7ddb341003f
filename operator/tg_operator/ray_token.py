"""The per-group Ray token: a Secret the operator creates, and how pods and clients get it.

Ray's token authentication (``RAY_AUTH_MODE=token``) makes the dashboard, the GCS and every
other control-plane service refuse requests without ``Authorization: Bearer <token>``.
KubeRay v1.5.0 (our pin) has no ``authOptions`` (it came in v1.5.1), so the operator does
what that option does: one Secret per TrainerGroup, ``<name>-ray-token`` with the key
``auth_token`` (KubeRay's key), owned by the TrainerGroup (garbage-collected with it), and
``RAY_AUTH_MODE`` / ``RAY_AUTH_TOKEN`` (from the Secret) on every Ray container.

The token is HMAC-SHA256(operator key, the TrainerGroup's uid): the operator can always
recompute it, so it needs ``create`` on Secrets and never ``get`` (it can read no Secret in
the cluster). The key (``TG_RAY_TOKEN_KEY``) comes from a Secret the Helm chart makes in the
operator's namespace. An operator given a token (``TG_RAY_AUTH_TOKEN``) uses that one for
every cluster instead (one shared token; tests against one local Ray head).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any

from tg_operator import names, owners
from tgapi import TrainerGroup
from tgapi.model import AUTH_TOKEN

TOKEN_KEY = "auth_token"
SECRET_SUFFIX = "-ray-token"


def secret_name(tg: TrainerGroup) -> str:
    return f"{names.cluster_name(tg)}{SECRET_SUFFIX}"


def uses_token(tg: TrainerGroup) -> bool:
    """Whether the operator secures this group's cluster (its own cluster, auth not off)."""
    rc = tg.spec.ray_cluster
    return rc is not None and rc.auth == AUTH_TOKEN


def new_token() -> str:
    """A random token (256 bits): for keys and tests."""
    return secrets.token_hex(32)


def derive_token(*, key: str, uid: str) -> str:
    """The group's token: HMAC-SHA256 of its uid under the operator's key (64 hex digits)."""
    if not key or not uid:
        raise ValueError("derive_token needs a key and the TrainerGroup's uid")
    return hmac.new(key.encode(), uid.encode(), hashlib.sha256).hexdigest()


def build_secret(tg: TrainerGroup, *, token: str) -> dict[str, Any]:
    """The Secret holding the group's token, owned by the TrainerGroup."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(tg),
            "namespace": tg.namespace,
            "labels": dict(names.labels(tg)),
            "ownerReferences": [owners.owner_reference(tg)],
        },
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_from_secret(secret: dict[str, Any]) -> str:
    """The token in a Secret read back from the API ("" when the key is absent)."""
    raw = (secret.get("data") or {}).get(TOKEN_KEY) or ""
    try:
        return base64.b64decode(raw).decode().strip()
    except (ValueError, UnicodeDecodeError):
        return ""


def token_env(tg: TrainerGroup) -> list[dict[str, Any]]:
    """The environment every Ray container of the group gets (empty when auth is off)."""
    if not uses_token(tg):
        return [{"name": "RAY_AUTH_MODE", "value": "disabled"}]
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {
            "name": "RAY_AUTH_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": secret_name(tg), "key": TOKEN_KEY}},
        },
    ]
