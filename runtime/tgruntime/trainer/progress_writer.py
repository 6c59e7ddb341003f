"""Rank 0's training progress into the group record, off the step's path.

A step hands its progress to :meth:`ProgressWriter.submit` and goes on; one daemon thread,
started on the first submit and kept, writes the newest value (a step that finishes while a
write is in flight replaces the value waiting, so a slow GCS never queues writes or delays a
collective), and at most one value per ``min_interval_s`` (1 s): the last value is always
written, at most that long after its step. A failed write is logged once at warning (later
ones at debug) and never reaches the step.

Why kept and paced: the writer shares the worker's interpreter lock with the training loop.
On an H200 (seed shape, ~306 ms steps) starting a thread per step cost ~0.45 ms in the call,
and a write after every step made the next step ~1 ms slower (docs/gpu.md, "The group's own
overhead").

Each value goes to two places (tgapi.progress): the group record in Ray's KV (``tgctl status``
reads it), and one JSON line in ``<Ray log dir>/trainergroup/progress.<ns>.<group>.json`` on
this node, replaced atomically, which the operator reads through the dashboard's log API.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from tgapi.progress import TrainingProgress, progress_filename

log = logging.getLogger(__name__)


MIN_INTERVAL_S = 1.0


class ProgressWriter:
    def __init__(
        self, *, group_name: str, ray_namespace: str, min_interval_s: float = MIN_INTERVAL_S
    ) -> None:
        self.group_name = group_name
        self.ray_namespace = ray_namespace
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._next: TrainingProgress | None = None
        self._thread: threading.Thread | None = None
        self._warned = False

    def submit(self, progress: TrainingProgress) -> None:
        """Write ``progress`` soon (in the background); returns at once."""
        with self._lock:
            self._next = progress
            self._wake.set()
            thread, start = self._thread, self._thread is None
            if thread is None:
                thread = self._thread = threading.Thread(
                    target=self._run, name="tg-progress", daemon=True
                )
        if start:
            thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                progress, self._next = self._next, None
            if progress is None:
                continue
            self._write(progress)
            if self.min_interval_s > 0:
                time.sleep(self.min_interval_s)  # a newer value waits; the newest is written

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
