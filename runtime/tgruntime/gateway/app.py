"""The Tinker gateway: one endpoint that speaks the groups' Tinker API and sends each request
to the group serving it (docs/tinker.md, "One endpoint for the cluster: the gateway").

How a request finds its group (gateway.routing gives the :class:`~routing.Route`):

- by ``base_model`` (create_model, a sampling session on the base model, the ``/hf/`` hub):
  the group whose spec names that model (the group list), else whose
  ``get_server_capabilities`` does (asked with the caller's key, kept a minute);
- by an id (model/run, ``tinker://`` path, sampler, request id): the group that answered with
  it before (learned from every answer proxied), else the one group that says it holds it when
  asked (``GET training_runs/{id}``, ``POST weights_info``, ``GET samplers/{id}``, and for a
  request id ``retrieve_future`` on all): so a restarted gateway finds ids it never saw.
  Groups ask with the caller's key, so another principal's object is missing on every group
  and the gateway answers the same 404 as for an id nobody holds;
- sessions: the gateway picks the id and opens the session on every group (a group that came
  later, or missed it, gets it before the first request that needs it there), so one
  ServiceClient trains on one group and samples on another; heartbeats and finish go to all.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tgruntime.gateway import routing
from tgruntime.gateway.groups import Group, Source
from tgruntime.gateway.owners import Owners, SessionEntry, key_digest
from tgruntime.gateway.routing import How, Route
from tgruntime.gateway.upstream import (
    UNREACHABLE,
    Answer,
    Upstream,
    body_then_rest,
    json_error,
    key_headers,
)

MODELS_TTL_S = 60.0  # a group's get_server_capabilities answer is kept this long
PROTO_SCAN_LIMIT = 1 << 20  # bytes of a protobuf body read to find its model_id at most
V1 = routing.V1


class Gateway:
    def __init__(
        self, *, source: Source, timeout_s: float = 120.0, connect_timeout_s: float = 10.0,
        max_body_bytes: int = 64 << 20,
    ) -> None:
        self.source = source
        self.owners = Owners()
        self.upstream = Upstream(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self.max_body_bytes = max_body_bytes
        self._asked: dict[str, tuple[float, tuple[str, ...]]] = {}  # group -> (when, models)
        self._names: frozenset[str] = frozenset()

    # -- the groups and their models -----------------------------------------------------
    def groups(self) -> tuple[Group, ...]:
        groups = self.source.groups()
        names = frozenset(g.name for g in groups)
        for gone in self._names - names:  # left the list: what was learned of it goes
            self.owners.forget_group(gone)
            self._asked.pop(gone, None)
        self._names = names
        return groups

    def _group(self, name: str | None) -> Group | None:
        return next((g for g in self.groups() if g.name == name), None)

    def served(self, g: Group) -> tuple[str, ...]:
        asked = self._asked.get(g.name)
        return tuple(dict.fromkeys(g.models + (asked[1] if asked else ())))

    def _remember_models(self, group: str, answer: Any) -> None:
        if isinstance(answer, dict):
            names = tuple(
                str(m.get("model_name")) for m in answer.get("supported_models") or ()
                if isinstance(m, dict) and m.get("model_name")
            )
            self._asked[group] = (time.monotonic(), names)

    async def _by_model(self, name: str | None, headers: dict[str, str]) -> Group | None:
        groups = self.groups()
        if name is None:
            return groups[0] if len(groups) == 1 else None
        for g in groups:
            if name in self.served(g):
                return g
        now = time.monotonic()
        stale = [
            g for g in groups
            if g.name not in self._asked or now - self._asked[g.name][0] > MODELS_TTL_S
        ]
        answers = await asyncio.gather(*(
            self.upstream.call(g, "GET", V1 + "get_server_capabilities", headers=headers)
            for g in stale
        ))
        for a in answers:
            if a.status == 200:
                self._remember_models(a.group, a.json())
        return next((g for g in groups if name in self.served(g)), None)

    def _unknown_model(self, name: str | None) -> web.Response:
        served = sorted({m for g in self.groups() for m in self.served(g)})
        if name is None:
            return json_error(
                f"base_model is required: this gateway serves several models {served}",
                status=400,
            )
        return json_error(
            f"base model {name!r} is not served by any TrainerGroup behind this gateway; "
            f"served: {served}", status=404,
        )

    # -- learning ------------------------------------------------------------------------
    def learn(self, group: Group, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except ValueError:
            return
        if isinstance(doc, dict):
            for kind, ident in routing.learned(doc):
                self.owners.learn(kind, ident, group.name)

    def _learn_answer(self, a: Answer) -> None:
        g = self._group(a.group)
        if g is not None and a.status == 200:
            self.learn(g, a.body)

    # -- the one handler -----------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body, data, proto_id = await self._read(request)
            r = routing.route(
                method=request.method, path=request.path, body=body, proto_model_id=proto_id,
                query=request.query,
            )
        except routing.NotRouted:
            return json_error(f"no such endpoint: {request.method} {request.path}", status=404)
        except ValueError as exc:
            return json_error(f"malformed request body: {exc}", status=400)
        headers = key_headers(request.headers)
        if r.how is How.LOCAL:
            return self._local(request)
        if not self.groups():
            why = f" ({self.source.error})" if self.source.error else ""
            return json_error(
                f"no TrainerGroup behind this gateway yet{why}", status=503, category="server"
            )
        if r.how is How.ANY:
            return await self._any(request, data)
        if r.how is How.ALL:
            return await self._all(request, r, headers)
        if r.how is How.NEW_SESSION:
            return await self._new_session(body or {}, headers)
        if r.how is How.SESSION:
            return await self._session(request, r, data, headers)
        if r.how is How.FUTURE:
            return await self._future(request, r, data, headers)
        group = await self._resolve(r, headers)
        if isinstance(group, web.Response):
            return group
        if r.session:
            refused = await self._ensure(r.session, group, headers)
            if refused is not None:
                return refused
        return await self.upstream.stream(request, group, data=data, learn=self.learn)

    async def _read(self, request: web.Request) -> tuple[dict[str, Any] | None, Any, str | None]:
        """(JSON body or None, what to send on, a protobuf body's model_id)."""
        if request.method in ("GET", "HEAD"):
            return None, None, None
        if request.path == V1 + "forward_backward":
            head, model_id = await self._proto_head(request)
            return None, body_then_rest(head, request), model_id
        raw = await request.read()
        body = None
        if raw and "json" in request.content_type:
            doc = json.loads(raw)
            body = doc if isinstance(doc, dict) else None
        return body, raw, None

    @staticmethod
    async def _proto_head(request: web.Request) -> tuple[list[bytes], str]:
        """The first chunks of a protobuf body, read until its model_id (field 1) shows;
        the rest is streamed on unread. A zstd body (the SDK's ``proto_compress_fwdbwd``)
        is decompressed as far as needed to see it."""
        unzip = None
        if request.headers.get("Content-Encoding", "").lower() == "zstd":
            import zstandard

            unzip = zstandard.ZstdDecompressor().decompressobj()
        head: list[bytes] = []
        seen = b""
        while True:
            chunk = await request.content.readany()
            if chunk:
                head.append(chunk)
                seen += unzip.decompress(chunk) if unzip is not None else chunk
            found = routing.proto_string(seen, 1, final=not chunk)
            if found is not None:
                return head, found
            if len(seen) > PROTO_SCAN_LIMIT:
                raise ValueError(f"no model_id in the first {PROTO_SCAN_LIMIT} bytes")

    def _local(self, request: web.Request) -> web.Response:
        if request.path.endswith("telemetry"):
            return web.json_response({"status": "accepted"})
        groups = self.groups()
        return web.json_response({
            "status": "ok",
            "groups": [{"name": g.name, "url": g.url, "models": list(self.served(g))}
                       for g in groups],
            **({"config_error": self.source.error} if self.source.error else {}),
        })

    # -- routes --------------------------------------------------------------------------
    async def _any(self, request: web.Request, data: Any) -> web.StreamResponse:
        last: web.StreamResponse | None = None
        for g in self.groups():
            last = await self.upstream.stream(request, g, data=data, learn=self.learn)
            if last.status != UNREACHABLE:
                return last
        assert last is not None
        return last

    async def _all(self, request: web.Request, r: Route, headers: dict[str, str]) -> web.Response:
        answers = await asyncio.gather(*(
            self.upstream.call(g, "GET", request.path, headers=headers) for g in self.groups()
        ))
        ok = [a for a in answers if a.status == 200 and isinstance(a.json(), dict)]
        if not ok:
            return _first_error(answers).response()
        for a in ok:
            self._learn_answer(a)
        if r.merge == "get_server_capabilities":
            for a in ok:
                self._remember_models(a.group, a.json())
            return web.json_response(routing.merge_capabilities([a.json() for a in ok]))
        got: dict[str, int | None] = {}
        for name in ("offset", "limit"):
            raw = request.query.get(name)
            if raw is not None and not raw.isdigit():
                return json_error(f"{name} must be a whole number >= 0, got {raw!r}", status=400)
            got[name] = None if raw is None else int(raw)
        assert r.merge is not None
        return web.json_response(routing.merge_listing(
            [a.json() for a in ok], name=r.merge, offset=got["offset"] or 0, limit=got["limit"]
        ))

    async def _new_session(self, body: dict[str, Any], headers: dict[str, str]) -> web.Response:
        sid = f"tg-{secrets.token_hex(16)}"
        sent = {**body, "session_id": sid}
        answers = await asyncio.gather(*(
            self.upstream.call(g, "POST", V1 + "create_session", headers=headers, body=sent)
            for g in self.groups()
        ))
        ok = {a.group for a in answers if a.status == 200 and _sid(a) == sid}
        if not ok:
            old = [a.group for a in answers if a.status == 200]
            if old:
                return json_error(
                    f"groups {old} answered create_session with ids of their own: their "
                    "servers predate the gateway (they must accept its session_id); upgrade "
                    "their image", status=502, category="server",
                )
            return _first_error(answers).response()
        kept = {k: v for k, v in body.items() if k != "session_id"}
        self.owners.new_session(sid, SessionEntry(
            creator=key_digest(headers.get("X-API-Key")), body=kept, groups=ok
        ))
        return web.json_response({"type": "create_session", "session_id": sid})

    async def _ensure(self, sid: str, group: Group, headers: dict[str, str]) -> web.Response | None:
        """``group`` holds session ``sid`` before a request that needs it there: a group added
        after the session began, or one that was down, gets it now (with the caller's key;
        after a gateway restart too, when the group answers its owner's id again)."""
        entry = self.owners.session(sid)
        caller = key_digest(headers.get("X-API-Key"))
        if entry is not None and (group.name in entry.groups or entry.creator != caller):
            return None  # held there, or not this key's session: the group decides
        body: dict[str, Any] = {**(entry.body if entry else {}), "session_id": sid}
        a = await self.upstream.call(
            group, "POST", V1 + "create_session", headers=headers, body=body
        )
        if a.status == 409:  # another principal's id: answered like a missing session
            return json_error(f"unknown session {sid!r}", status=404)
        if a.status != 200:
            return a.response()
        got = _sid(a)
        if got != sid:
            return json_error(
                f"group {group.name!r} answered create_session with another id ({got!r}): its "
                "server predates the gateway (it must accept the gateway's session_id); "
                "upgrade its image", status=502, category="server",
            )
        if entry is None:
            entry = SessionEntry(creator=caller, body={})
            self.owners.new_session(sid, entry)
        entry.groups.add(group.name)
        return None

    async def _session(
        self, request: web.Request, r: Route, data: Any, headers: dict[str, str]
    ) -> web.Response:
        """Heartbeat and finish: every group that holds the session (all, when not known)."""
        entry = self.owners.session(r.key) if r.key else None
        groups = [g for g in self.groups() if entry is None or g.name in entry.groups]
        sent = dict(headers)
        if request.content_type:
            sent["Content-Type"] = request.content_type
        answers = await asyncio.gather(*(
            self.upstream.call(g, request.method, request.path, headers=sent, data=data)
            for g in groups or self.groups()
        ))
        ok = [a for a in answers if a.status == 200]
        if ok and request.path.endswith("/finish") and r.key:
            self.owners.end_session(r.key)
        return ok[0].response() if ok else _first_error(answers).response()

    async def _future(
        self, request: web.Request, r: Route, data: Any, headers: dict[str, str]
    ) -> web.StreamResponse:
        """retrieve_future: to the group whose server made the id (its boot id, learned);
        else to every group at once, the one answer that is not 'unknown' (404/410) wins."""
        boot = routing.boot_of(r.key or "")
        group = self._group(self.owners.owner("boot", boot)) if boot else None
        if group is not None:
            return await self.upstream.stream(request, group, data=data, learn=self.learn)
        sent = {**headers, "Content-Type": "application/json"}
        if "Accept" in request.headers:
            sent["Accept"] = request.headers["Accept"]
        pending = {
            asyncio.ensure_future(
                self.upstream.call(g, "POST", request.path, headers=sent, data=data)
            )
            for g in self.groups()
        }
        answers: list[Answer] = []
        try:
            for next_done in asyncio.as_completed(pending):
                a = await next_done
                if a.status not in (404, 410, UNREACHABLE):
                    if boot:
                        self.owners.learn("boot", boot, a.group)
                    self._learn_answer(a)
                    return a.response()
                answers.append(a)
        finally:
            for t in pending:
                t.cancel()
        if any(a.status == 410 for a in answers):  # the SDK retries a 410
            return json_error(
                f"request {r.key} is held by no group behind this gateway (made before a "
                "group's server restarted, or no longer kept): retry it", status=410,
                category="server",
            )
        return _first_error(answers).response()

    async def _resolve(self, r: Route, headers: dict[str, str]) -> Group | web.Response:
        if r.how is How.SIGNED:
            # the group that answered for the run (learned from the answers proxied, e.g.
            # the link's own issue); unknown (a gateway restarted since): the first group,
            # whose 403/404 tells the caller to ask for a new link
            owner = self._group(self.owners.owner("model", routing.run_of(r.key or "") or ""))
            return owner or self.groups()[0]
        if r.how in (How.BASE, How.HUB):
            g = await self._by_model(r.key, headers)
            if g is None and r.how is How.HUB:
                g = await self._hub_owner(r.key or "", headers)
            return self._unknown_model(r.key) if g is None else g
        kind, probe = self._probe_of(r)
        if r.key is None or probe is None:
            return self.groups()[0]  # nothing to route by: that group's own answer says why
        known = self._group(self.owners.owner(kind, self._id_of(r)))
        if known is not None:
            return known
        method, path, body = probe
        answers = await asyncio.gather(*(
            self.upstream.call(g, method, path, headers=headers, body=body) for g in self.groups()
        ))
        for a in answers:
            if a.status == 200:
                self.owners.learn(kind, self._id_of(r), a.group)
                return self._group(a.group) or self.groups()[0]
        down = [a.group for a in answers if a.status == UNREACHABLE]
        if down:
            return json_error(
                f"{kind} {r.key!r} is held by no group that answered; groups {down} did not "
                "answer: retry", status=503, category="server",
            )
        # held by none (or not the caller's): the first group answers, with the same 404 a
        # group gives for a missing id as for another principal's, whether or not this
        # gateway has seen the id (its answer must not tell)
        return self.groups()[0]

    @staticmethod
    def _id_of(r: Route) -> str:
        if r.how is How.PATH:
            return routing.run_of(r.key or "") or ""
        return r.key or ""

    def _probe_of(self, r: Route) -> tuple[str, tuple[str, str, Any] | None]:
        """(kind learned, the request that asks a group whether it holds the id)."""
        key = r.key or ""
        if r.how is How.SAMPLER:
            return "sampler", ("GET", f"{V1}samplers/{key}", None)
        if r.how is How.PATH:
            ok = routing.run_of(key) is not None
            return "model", ("POST", V1 + "weights_info", {"tinker_path": key}) if ok else None
        ok = bool(key) and "/" not in key
        return "model", ("GET", f"{V1}training_runs/{key}", None) if ok else None

    async def _hub_owner(self, name: str, headers: dict[str, str]) -> Group | None:
        """A hub name no group lists (an alias such as the Llama 3 tokenizer's): the first
        group whose hub knows it."""
        for g in self.groups():
            a = await self.upstream.call(g, "GET", f"/hf/api/models/{name}", headers=headers)
            if a.status == 200:
                return g
        return None


def _sid(a: Answer) -> Any:
    doc = a.json()
    return doc.get("session_id") if isinstance(doc, dict) else None


def _first_error(answers: list[Answer]) -> Answer:
    """The answer to give when no group said yes: a refusal of the key first (401/403),
    then any other refusal, then an unreachable group."""
    for pick in (lambda s: s in (401, 403), lambda s: s != UNREACHABLE, lambda s: True):
        for a in answers:
            if pick(a.status):
                return a
    raise AssertionError("no answers")


def create_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.max_body_bytes)
    app["gateway"] = gateway
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]] = gateway.handle
    app.router.add_route("*", "/{tail:.*}", handler)

    async def on_startup(_: web.Application) -> None:
        await gateway.upstream.start()

    async def on_cleanup(_: web.Application) -> None:
        await gateway.upstream.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
