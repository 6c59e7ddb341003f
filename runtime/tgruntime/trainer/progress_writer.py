"""Rank 0's training progress into the group record, off the step's path.

A step hands its progress to :meth:`ProgressWriter.submit` and goes on; one daemon thread writes
the newest value (a step that finishes while a write is in flight replaces the value waiting, so
a slow GCS never queues writes or delays a collective). A failed write is logged once at
warning (later ones at debug) and never reaches the step.
"""

from __future__ import annotations

import logging
import threading

from tgapi.progress import TrainingProgress

log = logging.getLogger(__name__)


class ProgressWriter:
    def __init__(self, *, group_name: str, ray_namespace: str) -> None:
        self.group_name = group_name
        self.ray_namespace = ray_namespace
        self._lock = threading.Lock()
        self._next: TrainingProgress | None = None
        self._busy = False
        self._warned = False

    def submit(self, progress: TrainingProgress) -> None:
        """Write ``progress`` soon (in the background); returns at once."""
        with self._lock:
            self._next = progress
            if self._busy:
                return
            self._busy = True
        threading.Thread(target=self._drain, name="tg-progress", daemon=True).start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                progress, self._next = self._next, None
                if progress is None:
                    self._busy = False
                    return
            self._write(progress)

    def _write(self, progress: TrainingProgress) -> None:
        try:
            from tgruntime.controller import registry

            registry.update_record(
                group_name=self.group_name, ray_namespace=self.ray_namespace, training=progress
            )
        except Exception as exc:  # progress is a report: the step itself succeeded
            if self._warned:
                log.debug("training progress not recorded: %s", exc)
                return
            self._warned = True
            log.warning(
                "rank 0 of group %r: could not record training progress in the group record "
                "(%s: %s); training goes on (later failures are not logged)",
                self.group_name,
                type(exc).__name__,
                exc,
            )
