"""A trivial worker class for operator tests and the operator benchmark.

It is what ``spec.workers.workerClass: hack.noop_worker:NoopWorker`` names:
no torch, no Megatron, so a group of them starts in seconds. Ray worker processes
import it, so the local Ray must have the repository root on its PYTHONPATH.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tgruntime.controller import Dispatch, Worker, register


class NoopWorker(Worker):
    def __init__(self, spec_json: str = "{}") -> None:
        super().__init__()
        self.spec_json = spec_json

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank


CRASH_AFTER_S = 3.0


class CrashingWorker(NoopWorker):
    """A worker that exits ``CRASH_AFTER_S`` seconds after ``init_model``: a crash loop
    (``hack.noop_worker:CrashingWorker``, used by the operator's real-plane back-off test)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        threading.Timer(CRASH_AFTER_S, os._exit, args=(1,)).start()
        return {"rank": self.rank, "pid": os.getpid()}
