"""tgruntime: the code that runs inside Ray.

Each folder holds one kind of thing:

- ``controller``: the single-controller library (Worker, ResourcePool, WorkerGroup,
  register/Dispatch, DataProto, group records, teardown, health), the Ray connection
  (``connect``), the GCS view and Ray workarounds.
- ``trainer``: the Megatron trainer worker.
- ``service``: the Tinker HTTP service over a group.
- ``launch``: TrainerGroup spec -> a running detached group (plan, then create).
- ``driver``: ``TrainerClient``, the Python API over a running group (futures).
- ``entrypoints``: the processes (``server``, ``client_job``, ``teardown``, ``cli``).
- ``local``: a Ray head and cluster on this machine (tgctl's local mode).
- ``compat.verl``: verl's names over ``controller`` so verl code ports by imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tgruntime.driver.trainer_client import TrainerClient, TrainerFuture

__all__ = ["TrainerClient", "TrainerFuture"]


def __getattr__(name: str) -> Any:
    """``TrainerClient`` / ``TrainerFuture`` load on first use (``import tgruntime`` stays
    light)."""
    if name in __all__:
        value = getattr(importlib.import_module("tgruntime.driver.trainer_client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tgruntime' has no attribute {name!r}")
