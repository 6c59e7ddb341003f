"""Rank 0's training progress into the group record, off the step's path.

A step hands its progress to :meth:`ProgressWriter.submit` and goes on; one daemon thread writes
the newest value (a step that finishes while a write is in flight replaces the value waiting, so
a slow GCS never queues writes or delays a collective). A failed write is logged once at
warning (later ones at debug) and never reaches the step.

Each value goes to two places (tgapi.progress): the group record in Ray's KV (``tgctl status``
reads it), and one JSON line in ``<Ray log dir>/trainergroup/progress.<ns>.<group>.json`` on
this node, replaced atomically, which the operator reads through the dashboard's log API.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from tgapi.progress import TrainingProgress, progress_filename

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
            path = self.file_path()
            if path is not None:
                write_atomically(path, json.dumps(progress.to_wire()) + "\n")
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

    def file_path(self) -> Path | None:
        """This group's progress file on this node (None outside a Ray worker process)."""
        logs = ray_logs_dir()
        if logs is None:
            return None
        name = progress_filename(ray_namespace=self.ray_namespace, group_name=self.group_name)
        return Path(logs) / name


def ray_logs_dir() -> str | None:
    """The Ray log directory of this process's node (Ray keeps it on a private attribute)."""
    try:
        import ray._private.worker as ray_worker

        node = ray_worker.global_worker.node
        return str(node.get_logs_dir_path()) if node is not None else None
    except Exception:  # not a connected Ray process, or a Ray without the attribute
        return None


def write_atomically(path: Path, text: str) -> None:
    """``text`` into ``path`` so that a reader sees the old file or the new one, whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
