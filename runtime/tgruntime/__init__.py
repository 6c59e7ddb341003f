"""tgruntime: the code that runs inside Ray.

Packages and modules:

- ``controller``: the single-controller layer (Worker, ResourcePool, WorkerGroup,
  register/Dispatch, DataProto, group records, teardown, health).
- ``verl_compat``: verl's names over ``controller`` so verl code ports by imports.
- ``trainer``: the Megatron trainer worker.
- ``groups``: TrainerGroup spec -> a running detached group (used by server and tgctl).
- ``server`` / ``client`` / ``teardown``: the entrypoints the operator runs as Ray jobs.
- ``cli``: ``tgctl``, the local mode.
- ``trainer_client``: ``TrainerClient``, the Python API over a running group (futures).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tgruntime.trainer_client import TrainerClient, TrainerFuture

__all__ = ["TrainerClient", "TrainerFuture"]


def __getattr__(name: str) -> Any:
    """``TrainerClient`` / ``TrainerFuture`` load on first use (``import tgruntime`` stays
    light)."""
    if name in __all__:
        value = getattr(importlib.import_module("tgruntime.trainer_client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tgruntime' has no attribute {name!r}")
