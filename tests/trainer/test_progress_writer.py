"""ProgressWriter: the step never waits on the record, and the newest value wins (pure logic:
the record write is replaced by one that blocks until the test lets it go)."""

from __future__ import annotations

import threading
import time

from tgapi.progress import TrainingProgress
from tgruntime.trainer.progress_writer import ProgressWriter


class _Blocking(ProgressWriter):
    def __init__(self) -> None:
        super().__init__(group_name="g", ray_namespace="ns")
        self.release = threading.Event()
        self.written: list[int] = []

    def _write(self, progress: TrainingProgress) -> None:
        assert self.release.wait(timeout=10)
        self.written.append(progress.step)


def _p(step: int) -> TrainingProgress:
    return TrainingProgress(step=step, loss=1.0, grad_norm=1.0, tokens_per_s=1.0, last_step_at=0)


def test_submit_returns_at_once_and_the_newest_value_wins() -> None:
    w = _Blocking()
    t0 = time.monotonic()
    for step in range(1, 6):
        w.submit(_p(step))  # the first write blocks; the rest only replace the waiting value
    assert time.monotonic() - t0 < 1.0
    w.release.set()
    deadline = time.monotonic() + 10
    while (not w.written or w.written[-1] != 5) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.written == [1, 5]


def test_a_failed_write_never_raises() -> None:
    w = ProgressWriter(group_name="g", ray_namespace="ns")  # no Ray here: the write fails
    w._write(_p(1))
    w._write(_p(2))
    assert w._warned
