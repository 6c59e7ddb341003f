"""Which group a request goes to: pure functions of the request (method, path, JSON body or
the protobuf body's first bytes), no I/O. The gateway (gateway.app) resolves a :class:`Route`
to groups with what it learned (gateway.owners) or by asking them.

Ids pass through unchanged: a session id is the gateway's and every group holds it; a model
id is ``{session_id}:train:{n}`` (the SDK builds it itself); sampler, request and run ids are
the groups'. So nothing in a body is rewritten (protobuf bodies stay opaque bytes), and a
``tinker://`` path saved through the gateway is the same path on the group's own Service.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

V1 = "/api/v1/"
REQUEST_ID = re.compile(r"([0-9a-f]{12})-[0-9a-f]{32}")
"""A group's request id: its server's boot id, '-', 128 random bits (service.futures)."""


class How(enum.Enum):
    LOCAL = "local"  # the gateway answers itself (health, telemetry)
    ANY = "any"  # one group, whichever answers (client config)
    ALL = "all"  # every group, answers merged (capabilities, listings)
    NEW_SESSION = "new_session"  # the gateway picks the id; every group gets the session
    SESSION = "session"  # every group that holds the session (heartbeat, finish)
    BASE = "base"  # the group serving the base model named
    MODEL = "model"  # the group holding the model (training run) id
    PATH = "path"  # the group holding the tinker:// path's run
    SAMPLER = "sampler"  # the group holding the sampling session
    FUTURE = "future"  # the group whose server made the request id
    HUB = "hub"  # the group serving the org/model of a /hf/ path
    SIGNED = "signed"  # a signed download link: the group holding its tinker:// path's run


@dataclass(frozen=True, kw_only=True)
class Route:
    how: How
    key: str | None = None  # the id, base model, path or hub name routed by
    session: str | None = None  # a session the chosen group must hold first (ensured)
    merge: str | None = None  # How.ALL: "capabilities", "training_runs" or "checkpoints"


class NotRouted(ValueError):
    """A path the Tinker API does not have: the gateway answers 404 itself."""


def _text(body: Mapping[str, Any] | None, key: str) -> str | None:
    v = (body or {}).get(key)
    return None if v is None or v == "" else str(v)


_MODEL_ROUTES = frozenset(
    {"get_info", "optim_step", "save_weights", "save_weights_for_sampler",
     "save_weights_external"}
)
_BY_PATH = {"weights_info": "tinker_path", "copy_weights": "source_path"}
_MERGED = frozenset({"get_server_capabilities", "training_runs", "checkpoints"})


def route(
    *, method: str, path: str, body: Mapping[str, Any] | None = None,
    proto_model_id: str | None = None, query: Mapping[str, str] | None = None,
) -> Route:
    """The route of one request. ``body`` is the JSON body (None for GET and protobuf);
    ``proto_model_id`` the ``model_id`` read from a protobuf ``forward_backward`` body;
    ``query`` the URL's query (a signed link's ``path`` names its checkpoint)."""
    if path in ("/healthz", "/api/v1/healthz"):
        return Route(how=How.LOCAL)
    if path in ("/signed/archive", "/signed/file"):
        # service.signed's links carry no key (the signature is the credential), so the
        # gateway cannot ask the groups with the caller's key: the run's learned owner
        return Route(how=How.SIGNED, key=_text(query, "path"))
    if path.startswith("/hf/"):
        return Route(how=How.HUB, key=hub_name(path))
    if not path.startswith(V1):
        raise NotRouted(path)
    rest = path[len(V1):]
    parts = rest.split("/")
    if method == "GET" and rest in _MERGED:
        return Route(how=How.ALL, merge=rest)
    if parts[0] == "samplers" and len(parts) == 2:
        return Route(how=How.SAMPLER, key=parts[1])
    if parts[0] == "training_runs" and len(parts) >= 2:
        if len(parts) >= 5 and parts[2] == "checkpoints":
            return Route(how=How.PATH, key=f"tinker://{parts[1]}/{parts[3]}/{parts[4]}")
        return Route(how=How.MODEL, key=parts[1])
    if parts[0] == "sessions" and len(parts) == 3 and parts[2] == "finish":
        return Route(how=How.SESSION, key=parts[1])
    if method != "POST":
        raise NotRouted(path)
    return _post(rest, body, proto_model_id)


def _post(rest: str, body: Mapping[str, Any] | None, proto_model_id: str | None) -> Route:
    sid = _text(body, "session_id")
    if rest == "telemetry":
        return Route(how=How.LOCAL)
    if rest in ("client/config", "client/dynamic_config"):
        return Route(how=How.ANY)
    if rest == "create_session":
        return Route(how=How.NEW_SESSION)
    if rest == "session_heartbeat":
        return Route(how=How.SESSION, key=sid)
    if rest == "create_model":
        return Route(how=How.BASE, key=_text(body, "base_model"), session=sid)
    if rest in _MODEL_ROUTES:
        return Route(how=How.MODEL, key=_text(body, "model_id"))
    if rest == "forward_backward":
        return Route(how=How.MODEL, key=proto_model_id)
    if rest == "load_weights":
        if _text(body, "model_id"):
            return Route(how=How.MODEL, key=_text(body, "model_id"))
        return Route(how=How.PATH, key=_text(body, "path"), session=sid)
    if rest in ("create_sampling_session", "asample"):
        if rest == "asample" and _text(body, "sampling_session_id"):
            return Route(how=How.SAMPLER, key=_text(body, "sampling_session_id"))
        if _text(body, "model_path"):
            return Route(how=How.PATH, key=_text(body, "model_path"), session=sid)
        return Route(how=How.BASE, key=_text(body, "base_model"), session=sid)
    if rest == "retrieve_future":
        return Route(how=How.FUTURE, key=_text(body, "request_id"))
    if rest in _BY_PATH:
        return Route(how=How.PATH, key=_text(body, _BY_PATH[rest]))
    raise NotRouted(V1 + rest)


def hub_name(path: str) -> str:
    """``org/model`` of a ``/hf/`` path (service.routes.hub): ``/hf/{org}/{model}/resolve/..``
    or ``/hf/api/models/{org}/{model}[/...]``."""
    parts = path.split("/")[2:]
    if parts[:2] == ["api", "models"]:
        parts = parts[2:]
    if len(parts) < 2:
        raise NotRouted(path)
    return f"{parts[0]}/{parts[1]}"


def run_of(tinker_path: str) -> str | None:
    """The run (model) id of ``tinker://<run>/<kind>/<name>``; None for anything else."""
    if not tinker_path.startswith("tinker://"):
        return None
    run = tinker_path[len("tinker://"):].split("/", 1)[0]
    return run or None


def session_of(model_id: str) -> str | None:
    """The session id inside a model id ``{session_id}:train:{n}``."""
    head, sep, _ = model_id.partition(":train:")
    return head if sep else None


def boot_of(request_id: str) -> str | None:
    """The boot id of the group server that made ``request_id``; None for another shape."""
    m = REQUEST_ID.fullmatch(request_id)
    return m.group(1) if m else None


def learned(body: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """The (kind, id) pairs a group's JSON answer names, so the gateway knows that group holds
    them: ``model``, ``sampler``, ``boot`` (of a request id)."""
    for key in ("model_id", "training_run_id"):
        if isinstance(body.get(key), str):
            yield "model", body[key]
    if isinstance(body.get("sampling_session_id"), str):
        yield "sampler", body["sampling_session_id"]
    rid = body.get("request_id")
    if isinstance(rid, str) and boot_of(rid):
        yield "boot", str(boot_of(rid))
    for key in ("path", "tinker_path"):
        v = body.get(key)
        run = run_of(v) if isinstance(v, str) else None
        if run:
            yield "model", run
    for listed in ("training_runs", "checkpoints"):
        for item in body.get(listed) or ():
            if isinstance(item, Mapping):
                yield from learned(item)


# -- protobuf: the model id of a forward_backward body, from its first bytes ---------------
def _varint(data: bytes, i: int) -> tuple[int, int] | None:
    shift = value = 0
    while i < len(data):
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("a protobuf varint longer than 10 bytes")
    return None


def proto_string(data: bytes, number: int, *, final: bool) -> str | None:
    """The string field ``number`` of a protobuf message whose first bytes are ``data``;
    None when more bytes are needed (``final``: ``data`` is the whole message, so a missing
    field is ``""``). Fields before it are skipped by their wire types, never decoded; the SDK
    writes ``ForwardBackwardRequest.model_id`` (field 1) first, so a few bytes suffice."""
    i = 0
    while i < len(data):
        tag = _varint(data, i)
        if tag is None:
            break
        field, wire, j = tag[0] >> 3, tag[0] & 7, tag[1]
        if wire == 0:
            v = _varint(data, j)
            if v is None:
                break
            j = v[1]
        elif wire in (1, 5):
            j += 8 if wire == 1 else 4
        elif wire == 2:
            n = _varint(data, j)
            if n is None:
                break
            j = n[1]
            if field == number:
                if j + n[0] > len(data):
                    break
                return data[j : j + n[0]].decode("utf-8")
            j += n[0]
        else:
            raise ValueError(f"protobuf wire type {wire} is not supported here")
        if j > len(data):
            break
        i = j
    else:
        return "" if final else None
    if final:
        raise ValueError("the protobuf body ends inside a field")
    return None


# -- answers of every group, merged ------------------------------------------------------
def merge_capabilities(answers: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One ``get_server_capabilities`` answer: every group's models (first of a name wins);
    the other fields of the first group, and ``groups``: each group's own answer."""
    models: dict[str, Any] = {}
    for a in answers:
        for m in a.get("supported_models") or ():
            if isinstance(m, Mapping):
                models.setdefault(str(m.get("model_name")), dict(m))
    out = dict(answers[0]) if answers else {}
    out["supported_models"] = list(models.values())
    out["groups"] = [dict(a) for a in answers]
    return out


def paged(
    items: list[dict[str, Any]], *, name: str, offset: int, limit: int | None
) -> dict[str, Any]:
    """The SDK's page shape (service.routes.checkpoints) over a merged listing."""
    end = len(items) if limit is None else offset + limit
    lim = len(items) if limit is None else limit
    return {
        name: items[offset:end],
        "cursor": {"offset": offset, "limit": lim, "total_count": len(items)},
    }


def merge_listing(
    answers: list[Mapping[str, Any]], *, name: str, offset: int, limit: int | None
) -> dict[str, Any]:
    """``training_runs`` (by id) or ``checkpoints`` (newest first) of every group, one page."""
    items = [dict(i) for a in answers for i in a.get(name) or () if isinstance(i, Mapping)]
    if name == "checkpoints":
        items.sort(key=lambda c: str(c.get("time")), reverse=True)
    else:
        items.sort(key=lambda r: str(r.get("training_run_id")))
    return paged(items, name=name, offset=offset, limit=limit)
