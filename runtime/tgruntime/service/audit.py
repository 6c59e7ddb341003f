"""The audit log: one JSON line per mutating request (logger ``tgruntime.service.audit``, at
INFO whatever ``--log-level`` says): who (the principal; null when the key was refused), what
(the action), which object, and the outcome (HTTP status, and the error when refused). Keys
are never logged; neither are request bodies beyond the ids and paths they name.

An admin principal's request that used its admin right on another principal's objects
(service.policy) is logged whether it mutates or only reads (a listing of everyone's runs),
marked ``"admin": true`` with the ``owners`` whose objects it reached."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

audit_log = logging.getLogger("tgruntime.service.audit")
audit_log.setLevel(logging.INFO)

# the routes that create, change or end something (not reads, polls or heartbeats)
MUTATING = frozenset(
    {
        "create_session",
        "finish",
        "create_model",
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "load_weights",
        "create_sampling_session",
        "copy_weights",
        "save_weights_external",
    }
)

_OBJECT_FIELDS = ("session_id", "model_id", "path", "model_path", "sampling_session_id")
_RESULT_FIELDS = ("session_id", "model_id", "sampling_session_id", "request_id")


def action_of(path: str, method: str = "POST") -> str | None:
    """The audited action of ``/api/v1/...`` (None when it mutates nothing)."""
    if not path.startswith("/api/v1/"):
        return None
    route = path[len("/api/v1/") :]
    if route.startswith("sessions/") and route.endswith("/finish"):
        route = "finish"
    parts = route.split("/")
    if len(parts) == 7 and parts[0] == "training_runs" and parts[5] == "readers":
        return {"PUT": "share_checkpoint", "DELETE": "unshare_checkpoint"}.get(method)
    if parts[0] == "training_runs" and len(parts) in (5, 6) and parts[2] == "checkpoints":
        # only DELETE, PUT .../ttl, .../publish and GET .../archive or
        # .../external_weights_urls (signed links are credentials: who got one is logged)
        # have these paths (the listings are shorter)
        if len(parts) == 5:
            return "delete_checkpoint"
        return {
            "ttl": "set_checkpoint_ttl",
            "publish": "publish_checkpoint",
            "archive": "checkpoint_archive_link",
            "external_weights_urls": "external_weights_urls",
        }.get(parts[5])
    return route if route in MUTATING else None


def _json_of(raw: bytes | None) -> dict[str, Any]:
    if not raw or len(raw) > 1 << 16:
        return {}
    try:
        out = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return out if isinstance(out, dict) else {}


def _ids(src: dict[str, Any], fields: tuple[str, ...]) -> dict[str, str]:
    return {k: str(src[k]) for k in fields if isinstance(src.get(k), str | int) and src[k] != ""}


def _read_action(path: str) -> str:
    """A read's name for an admin's audit line: its route without ids (``training_runs``)."""
    parts = path[len("/api/v1/") :].split("/") if path.startswith("/api/v1/") else [path]
    return parts[0] if len(parts) < 3 else f"{parts[0]}/{parts[2]}"


async def record(
    request: web.Request,
    principal: str | None,
    response: web.StreamResponse,
    started: float,
    admin_on: set[str] | None = None,
) -> None:
    """Log ``request`` when it is a mutating one, or an admin's on others' objects (after its
    answer)."""
    action = action_of(request.path, request.method)
    if admin_on and action is None:
        action = _read_action(request.path)
    if action is None or not audit_log.isEnabledFor(logging.INFO):
        return
    obj: dict[str, str] = dict(request.match_info)
    if request.content_type == "application/json" and request.body_exists:
        obj |= _ids(_json_of(await request.read()), _OBJECT_FIELDS)  # cached by the handler
    body = response.body if isinstance(response, web.Response) else None
    answer = _json_of(bytes(body) if isinstance(body, bytes | bytearray) else None)
    line: dict[str, Any] = {
        "event": "audit",
        "principal": principal,
        "action": action,
        "object": obj,
        "status": response.status,
        "outcome": "ok" if response.status < 400 else "refused",
        "result": _ids(answer, _RESULT_FIELDS),
        "ms": round((time.monotonic() - started) * 1000, 1),
    }
    if admin_on:
        line["admin"] = True
        line["owners"] = sorted(admin_on)
    if response.status >= 400 and isinstance(answer.get("error"), str):
        line["error"] = answer["error"][:300]
    audit_log.info(json.dumps(line, default=str))
