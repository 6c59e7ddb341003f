"""A cap on the Ray jobs the operator keeps in flight on one Ray cluster.

Every server and teardown entrypoint runs as a job driver on the Ray head. A
hundred TrainerGroups applied at once on one shared RayCluster (``rayClusterRef``)
would otherwise start a hundred driver processes there at the same time. A job
takes a slot when it is submitted and gives it back when the operator sees it
finish; ``TG_MAX_CONCURRENT_JOBS`` slots exist per dashboard URL. Slots live in
memory: after an operator restart the jobs already running are not counted (at
most one extra batch), and a slot not released within ``stale_after_s`` is
reclaimed. A group that finds no free slot is woken (``on_free``) when one frees.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class JobSlots:
    def __init__(self, *, limit: int, stale_after_s: float = 3600.0) -> None:
        self.limit = limit
        self.stale_after_s = stale_after_s
        self._held: dict[str, dict[str, float]] = {}
        self._waiting: dict[str, set[str]] = {}
        self.on_free: Callable[[str], None] | None = None
        """Called with each waiter's key when a slot on its URL frees."""

    def acquire(self, url: str, submission_id: str, *, waiter: str = "") -> bool:
        """Take a slot for ``submission_id`` (True if it holds one now).

        When none is free, ``waiter`` (a group's key) is told through ``on_free`` later.
        """
        held = self._held.setdefault(url, {})
        now = time.monotonic()
        for sid, since in list(held.items()):
            if now - since > self.stale_after_s:
                del held[sid]
        if submission_id in held:
            return True
        if self.limit > 0 and len(held) >= self.limit:
            if waiter:
                self._waiting.setdefault(url, set()).add(waiter)
            return False
        held[submission_id] = now
        return True

    def has_room(self, url: str, submission_id: str) -> bool:
        """Whether :meth:`acquire` would give ``submission_id`` a slot now (takes none)."""
        held = self._held.get(url, {})
        now = time.monotonic()
        live = [s for s, since in held.items() if now - since <= self.stale_after_s]
        return submission_id in live or self.limit <= 0 or len(live) < self.limit

    def wait_for(self, url: str, *, waiter: str) -> None:
        """Tell ``waiter`` (a group's key) through ``on_free`` when a slot on ``url`` frees."""
        self._waiting.setdefault(url, set()).add(waiter)

    def release(self, url: str, submission_id: str) -> None:
        if self._held.get(url, {}).pop(submission_id, None) is not None:
            self._freed(url)

    def release_prefix(self, prefix: str) -> None:
        """Give back every slot of one TrainerGroup (its ids share a prefix)."""
        for url, held in self._held.items():
            gone = [s for s in held if s.startswith(prefix)]
            for sid in gone:
                del held[sid]
            if gone:
                self._freed(url)

    def _freed(self, url: str) -> None:
        waiting = self._waiting.pop(url, set())
        if self.on_free is not None:
            for key in sorted(waiting):
                self.on_free(key)

    def in_flight(self, url: str) -> int:
        return len(self._held.get(url, {}))
