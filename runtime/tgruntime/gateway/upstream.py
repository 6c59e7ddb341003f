"""Calls to the groups' Tinker servers: one aiohttp client with a timeout on every call,
the caller's key forwarded as it came (the groups' principals decide; the gateway has no key
of its own), answers either read whole (small JSON: probes, fan-outs) or streamed back."""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from tgruntime.gateway.groups import Group

log = logging.getLogger("tgruntime.gateway")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Date", "Server",
    )
)
KEY_HEADERS = ("X-API-Key", "Authorization")  # what the groups' principals are read from
LEARN_CAP = 1 << 20  # JSON answers up to this size are read whole (their ids learned)
UNREACHABLE = 502  # the status of an Answer whose group did not answer


def json_error(message: str, *, status: int, category: str = "user") -> web.Response:
    return web.json_response({"error": message, "category": category}, status=status)


def forwarded(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The caller's headers a group gets: all but the hop-by-hop ones."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


def key_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Only the caller's credentials (probes and fan-outs send nothing else of the request)."""
    return {k: headers[k] for k in KEY_HEADERS if k in headers}


@dataclass(frozen=True, kw_only=True)
class Answer:
    """A group's answer, read whole."""

    group: str
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        if "json" not in self.headers.get("Content-Type", ""):
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def response(self) -> web.Response:
        out = CIMultiDict((k, v) for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP)
        return web.Response(status=self.status, body=self.body, headers=out)


class Upstream:
    def __init__(self, *, timeout_s: float, connect_timeout_s: float) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._contexts: dict[str, ssl.SSLContext] = {}

    def tls(self, group: Group) -> ssl.SSLContext | bool:
        """How ``group``'s server is verified: against its own CA only (an SSL context per CA,
        kept while a group names it), else the system's roots (aiohttp's default)."""
        if not group.ca or not group.url.startswith("https://"):
            return True
        ctx = self._contexts.get(group.ca)
        if ctx is None:
            if len(self._contexts) >= 256:  # CAs rotate: drop the oldest
                self._contexts.pop(next(iter(self._contexts)))
            ctx = self._contexts[group.ca] = ssl.create_default_context(cadata=group.ca)
        return ctx

    async def start(self) -> None:
        # bodies pass through as they are (a gzip or zstd answer stays encoded)
        self._http = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self._http is not None, "Upstream.start() first"
        return self._http

    async def call(
        self, group: Group, method: str, path: str, *, headers: Mapping[str, str],
        body: Any = None, data: bytes | None = None,
    ) -> Answer:
        """One call, its answer read whole; a group that does not answer (refused
        connection, timeout) gives an :data:`UNREACHABLE` answer naming it."""
        try:
            async with self.http.request(
                method, group.url + path, headers=dict(headers), json=body, data=data,
                allow_redirects=False, ssl=self.tls(group),
            ) as up:
                raw = await up.read()
                return Answer(group=group.name, status=up.status,
                              headers=CIMultiDict(up.headers), body=raw)
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError) as exc:
            why = f"group {group.name!r} ({group.url}) did not answer: {type(exc).__name__}: {exc}"
            log.warning(json.dumps({"event": "unreachable", "group": group.name, "error": why}))
            return Answer(
                group=group.name, status=UNREACHABLE,
                headers=CIMultiDict({"Content-Type": "application/json"}),
                body=json.dumps({"error": why, "category": "server"}).encode(),
            )

    async def stream(
        self, request: web.Request, group: Group, *, data: Any,
        learn: Any,
    ) -> web.StreamResponse:
        """Forward ``request`` (its body: ``data``, bytes or an async iterator) to ``group``
        and stream the answer back; a small JSON answer is read whole and given to ``learn``
        first (the ids it names)."""
        headers = forwarded(request.headers)
        # links a group makes (an archive URL) name the gateway, the address the caller used
        headers.setdefault("X-Forwarded-Host", request.host)
        headers.setdefault("X-Forwarded-Proto", request.scheme)
        if request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)
        try:
            async with self.http.request(
                request.method, group.url + request.path_qs, headers=headers, data=data,
                allow_redirects=False, ssl=self.tls(group),
            ) as up:
                out = CIMultiDict(
                    (k, v) for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP
                )
                size = up.content_length
                if up.status in (204, 304) or (request.method == "HEAD" and size is None):
                    return web.Response(status=up.status, headers=out)
                if "json" in up.headers.get("Content-Type", "") and (
                    size is not None and size <= LEARN_CAP
                ):
                    raw = await up.read()
                    learn(group, raw)
                    return web.Response(status=up.status, body=raw, headers=out)
                resp = web.StreamResponse(status=up.status, headers=out)
                if size is not None:
                    resp.content_length = size
                await resp.prepare(request)
                async for chunk in up.content.iter_chunked(1 << 16):
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, TimeoutError, ssl.SSLError) as exc:
            why = f"group {group.name!r} ({group.url}) did not answer: {type(exc).__name__}: {exc}"
            log.warning(json.dumps({"event": "unreachable", "group": group.name, "error": why}))
            return json_error(why + "; retry", status=UNREACHABLE, category="server")


async def body_then_rest(
    head: list[bytes], request: web.Request
) -> AsyncIterator[bytes]:
    """The chunks already read, then the rest of the request body as it arrives."""
    for chunk in head:
        yield chunk
    async for chunk in request.content.iter_chunked(1 << 16):
        yield chunk
