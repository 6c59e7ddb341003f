"""The built-in Megatron trainer: a GPT model on megatron-core, trained on CPU or GPU.

``TrainEngine`` (``engine.py``) is one rank of a training job without Ray; the Ray worker
``MegatronTrainer`` lives in ``worker.py``. Names are imported lazily (PEP 562), so the
pure modules (``losses``, ``token_batch``) load without megatron. Importing the package puts
the ``deferred_compile`` hook in place (megatron-core's import-time ``torch.compile`` waits for
a first call), without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tgruntime.trainer import deferred_compile

if TYPE_CHECKING:
    from tgruntime.trainer.engine import StepResult, TrainEngine

__all__ = ["StepResult", "TrainEngine"]

deferred_compile.install()


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module("tgruntime.trainer.engine"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tgruntime.trainer' has no attribute {name!r}")
