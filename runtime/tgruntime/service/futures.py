"""Request ids and their futures; ``retrieve_future`` long-polls them.

Ids carry this server's boot id, so an id from before a restart is recognised and fails
with a retryable server error instead of hanging, and 128 random bits, so that one's own id
tells nothing of another's. Each future records its owner: another principal's id is
answered like an unknown one.
"""

from __future__ import annotations

import asyncio
import collections
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tgruntime.service.policy import POLICY


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


class FutureStore:
    def __init__(self, *, keep_s: float = 3600.0, delivered_keep_s: float = 30.0) -> None:
        """A finished future is kept ``keep_s`` for a client to fetch, and ``delivered_keep_s``
        once fetched (for a client whose answer was lost on the way and asks again): a long
        training loop holds its last seconds of outputs, not its last hour."""
        self.boot = uuid.uuid4().hex[:12]
        self._entries: dict[str, _Entry] = {}
        self._keep_s = keep_s
        self._delivered_keep_s = delivered_keep_s
        self._queued: collections.Counter[str] = collections.Counter()  # owner -> pending

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
            del self._entries[k]

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
            if not rid.startswith(self.boot + "-"):
                return Outcome(
                    error=f"request {rid} was made before the Tinker server restarted; its "
                    "result is lost (the group and saved weights are intact): retry it",
                    category="server",
                )
            return Outcome(error=f"unknown request id {rid!r}", category="user")
        if entry.outcome is None:
            try:
                await asyncio.wait_for(entry.event.wait(), timeout_s)
            except TimeoutError:
                return None
        if entry.delivered_at is None:
            entry.delivered_at = time.monotonic()
        return entry.outcome
