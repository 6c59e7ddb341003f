"""Request ids and their futures; ``retrieve_future`` long-polls them.

Ids carry this server's boot id, so an id from before a restart is recognised and fails
with a retryable server error instead of hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any


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


class FutureStore:
    def __init__(self, *, keep_s: float = 3600.0) -> None:
        self.boot = uuid.uuid4().hex[:12]
        self._ids = itertools.count(1)
        self._entries: dict[str, _Entry] = {}
        self._keep_s = keep_s

    def new(self) -> str:
        rid = f"{self.boot}-{next(self._ids)}"
        self._entries[rid] = _Entry()
        return rid

    def resolve(self, rid: str, outcome: Outcome) -> None:
        entry = self._entries.get(rid)
        if entry is None or entry.outcome is not None:
            return
        entry.outcome = outcome
        entry.done_at = time.monotonic()
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
            if e.done_at is not None and now - e.done_at > self._keep_s
        ]
        for k in old:
            del self._entries[k]

    async def wait(self, rid: str, timeout_s: float) -> Outcome | None:
        """The outcome, or None while still pending after ``timeout_s`` (a 408)."""
        entry = self._entries.get(rid)
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
        return entry.outcome
