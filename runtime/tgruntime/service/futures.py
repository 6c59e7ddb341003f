"""Request ids and their futures; ``retrieve_future`` long-polls them.

Ids are ``<boot>-<128 random bits>`` (hex): the boot id of the server that made them, and
bits that make one's own id tell nothing of another's. A well-formed id the store does not
hold (made before a restart, expired after it was kept, pushed out by its owner's newer
fetched results, or another principal's: all answered alike) is *gone*: HTTP 410, which SDK
0.38 turns into a ``RetryableException`` (a sampling client re-sends the sample by itself; a
training call reports it). An id of any other shape is a 404.
"""

from __future__ import annotations

import asyncio
import collections
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tgruntime.service.policy import POLICY
from tgruntime.service.sessions import ServiceError

REQUEST_ID = re.compile(r"[0-9a-f]{12}-[0-9a-f]{32}")
"""The shape of every request id a server makes (:meth:`FutureStore.new`)."""


def lost(rid: str, boot: str) -> ServiceError:
    """The error for a request id the store does not hold: 410 when it is well-formed, with
    the likely reason; 404 otherwise."""
    if REQUEST_ID.fullmatch(rid) is None:
        return ServiceError(f"unknown request id {rid[:80]!r}: not an id this server makes",
                            status=404)
    if not rid.startswith(boot + "-"):
        why = ("was made before the Tinker server restarted; its result is lost (the group and "
               "saved weights are intact): retry it")
    else:
        why = ("is no longer held (a result is kept an hour unfetched, among its owner's "
               "newest unfetched results; once fetched, 30 s and only among its owner's newest "
               "fetched results): retry it")
    return ServiceError(f"request {rid} {why}", status=410, category="server")


@dataclass
class Outcome:
    """What a finished request gives: protobuf bytes, a JSON body, or an error."""

    proto: bytes | None = None
    body: dict[str, Any] | None = None
    error: str | None = None
    category: str = "user"


@dataclass
class _Entry:
    event: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    done_at: float | None = None
    delivered_at: float | None = None  # when a retrieve_future first answered its outcome
    owner: str = "default"

    def size(self) -> int:
        """The payload bytes its outcome holds (protobuf; a JSON body or an error is small)."""
        out = self.outcome
        return len(out.proto) if out is not None and out.proto is not None else 0


class FutureStore:
    def __init__(
        self,
        *,
        keep_s: float = 3600.0,
        keep_n: int = 1024,
        keep_bytes: int = 1 << 30,
        delivered_keep_s: float = 30.0,
        delivered_keep_n: int = 64,
        delivered_keep_bytes: int = 64 << 20,
    ) -> None:
        """A finished future is kept ``keep_s`` for a client to fetch, and only among its
        owner's ``keep_n`` newest unfetched results, whose payloads sum to at most
        ``keep_bytes`` (the newest is always kept): a client that sends and never fetches
        holds a bounded number of results, not an hour of them. Once fetched it is kept for a
        client whose answer was lost on the way and asks again: ``delivered_keep_s`` at most,
        and only among its owner's ``delivered_keep_n`` newest fetched results, whose payloads
        sum to at most ``delivered_keep_bytes``. A long training loop holds a bounded tail of
        its outputs, whatever its pace."""
        self.boot = uuid.uuid4().hex[:12]
        self._entries: dict[str, _Entry] = {}
        self._keep_s = keep_s
        self._keep = (keep_n, keep_bytes)
        self._delivered_keep_s = delivered_keep_s
        self._delivered_keep = (delivered_keep_n, delivered_keep_bytes)
        self._queued: collections.Counter[str] = collections.Counter()  # owner -> pending
        # owner -> its finished results still held, oldest first: request id -> payload bytes
        # (unfetched ones, and fetched ones, each in order of finishing / first delivery)
        self._unfetched: dict[str, collections.OrderedDict[str, int]] = {}
        self._delivered: dict[str, collections.OrderedDict[str, int]] = {}

    def new(self, owner: str = "default") -> str:
        rid = f"{self.boot}-{secrets.token_hex(16)}"
        self._entries[rid] = _Entry(owner=owner)
        self._queued[owner] += 1
        return rid

    def queued(self, owner: str) -> int:
        """The principal's requests accepted and not finished (service.limits)."""
        return self._queued[owner]

    def resolve(self, rid: str, outcome: Outcome) -> None:
        entry = self._entries.get(rid)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome = outcome
        entry.done_at = time.monotonic()
        self._queued[entry.owner] -= 1
        if self._queued[entry.owner] <= 0:
            del self._queued[entry.owner]
        entry.event.set()
        self._hold(self._unfetched, rid, entry, self._keep)
        self._expire()

    def fail(self, rid: str, message: str, category: str = "user") -> None:
        self.resolve(rid, Outcome(error=message, category=category))

    def pending(self) -> int:
        return sum(1 for e in self._entries.values() if e.outcome is None)

    def _expire(self) -> None:
        now = time.monotonic()
        old = [
            k
            for k, e in self._entries.items()
            if (e.done_at is not None and now - e.done_at > self._keep_s)
            or (e.delivered_at is not None and now - e.delivered_at > self._delivered_keep_s)
        ]
        for k in old:
            self._forget(k)

    def _forget(self, rid: str) -> None:
        entry = self._entries.pop(rid)
        self._unlist(self._unfetched, rid, entry.owner)
        self._unlist(self._delivered, rid, entry.owner)

    @staticmethod
    def _unlist(
        lists: dict[str, collections.OrderedDict[str, int]], rid: str, owner: str
    ) -> None:
        held = lists.get(owner)
        if held is not None and held.pop(rid, None) is not None and not held:
            del lists[owner]

    def _hold(
        self,
        lists: dict[str, collections.OrderedDict[str, int]],
        rid: str,
        entry: _Entry,
        bounds: tuple[int, int],
    ) -> None:
        """List ``rid`` as its owner's newest in ``lists``; the owner's oldest there past
        ``bounds`` (count, payload bytes) go, the newest never."""
        held = lists.setdefault(entry.owner, collections.OrderedDict())
        held[rid] = entry.size()
        total = sum(held.values())
        while len(held) > 1 and (len(held) > bounds[0] or total > bounds[1]):
            old, size = next(iter(held.items()))
            total -= size
            self._forget(old)

    def _delivered_now(self, rid: str, entry: _Entry) -> None:
        """Record a first delivery; the owner's oldest fetched results past the bounds go."""
        entry.delivered_at = time.monotonic()
        self._unlist(self._unfetched, rid, entry.owner)
        self._hold(self._delivered, rid, entry, self._delivered_keep)

    def __len__(self) -> int:
        return len(self._entries)

    async def wait(
        self, rid: str, timeout_s: float, principal: str = "default"
    ) -> Outcome | None:
        """The outcome, or None while still pending after ``timeout_s`` (a 408)."""
        self._expire()
        entry = self._entries.get(rid)
        if entry is not None and not POLICY.may_see(principal, entry.owner):
            entry = None  # another principal's: answered as an unknown id
        if entry is None:
            raise lost(rid, self.boot)
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.event.wait(), timeout_s)
            except TimeoutError:
                return None
        outcome = entry.outcome
        if entry.delivered_at is None and rid in self._entries:
            self._delivered_now(rid, entry)
        return outcome
