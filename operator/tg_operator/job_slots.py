"""A cap on the Ray jobs the operator keeps in flight on one Ray cluster.

Every server and teardown entrypoint runs as a job driver on the Ray head. A
hundred TrainerGroups applied at once on one shared RayCluster (``rayClusterRef``)
would otherwise start a hundred driver processes there at the same time. A job
takes a slot when it is submitted and gives it back when the operator sees it
finish; ``TG_MAX_CONCURRENT_JOBS`` slots exist per dashboard URL. Slots live in
memory: after an operator restart the jobs already running are not counted (at
most one extra batch), and a slot not released within ``stale_after_s`` is
reclaimed.
"""

from __future__ import annotations

import time


class JobSlots:
    def __init__(self, *, limit: int, stale_after_s: float = 3600.0) -> None:
        self.limit = limit
        self.stale_after_s = stale_after_s
        self._held: dict[str, dict[str, float]] = {}

    def acquire(self, url: str, submission_id: str) -> bool:
        """Take a slot for ``submission_id`` (True if it holds one now)."""
        held = self._held.setdefault(url, {})
        now = time.monotonic()
        for sid, since in list(held.items()):
            if now - since > self.stale_after_s:
                del held[sid]
        if submission_id in held:
            return True
        if self.limit > 0 and len(held) >= self.limit:
            return False
        held[submission_id] = now
        return True

    def release(self, url: str, submission_id: str) -> None:
        self._held.get(url, {}).pop(submission_id, None)

    def release_prefix(self, prefix: str) -> None:
        """Give back every slot of one TrainerGroup (its ids share a prefix)."""
        for held in self._held.values():
            for sid in [s for s in held if s.startswith(prefix)]:
                del held[sid]

    def in_flight(self, url: str) -> int:
        return len(self._held.get(url, {}))
