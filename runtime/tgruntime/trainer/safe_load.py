"""Loading ``.pt`` state files without letting a crafted file run code (issue 37).

Everything the workers read from a checkpoint volume goes through :func:`load_state`:
``torch.load(weights_only=True)``, whose unpickler builds only tensors, containers, plain
Python values and the globals of an explicit allow-list, never calling anything else a pickle
names (``os.system``, ``eval``, a class's ``__reduce__``...). The allow-list,
:data:`SAFE_GLOBALS`, is exactly what our own saves contain beyond that (found by saving a
real checkpoint, full-weight and LoRA, and loading it with ``weights_only=True``): numpy's
legacy RNG state, ``np.random.get_state()``, which pickles as an ``ndarray`` of ``uint32``.
Model weights, AdamW state (megatron's and torch's ``state_dict``: dicts, lists, tuples,
numbers, tensors), CUDA RNG states and adapter tensors need nothing more.

A file that names anything else is refused with :class:`pickle.UnpicklingError` naming the
file, what it was expected to hold, and the global it tried to use; nothing in it has run.
Hugging Face weights are read with safetensors (no code at all); ``meta.json`` and the
sampler markers with ``json``.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy._core.multiarray import _reconstruct

__all__ = ["SAFE_GLOBALS", "load_state", "refusal"]

# np.random.get_state(): ("MT19937", ndarray[uint32], int, int, float); rebuilding the array
# takes its reconstructor, the class (only ndarray itself: a subclass is not allowed) and
# its dtype (the uint32 dtype class, nothing of object dtype)
SAFE_GLOBALS: list[Any] = [
    _reconstruct,
    np.ndarray,
    np.dtype,
    np.dtypes.UInt32DType,
]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_BUILT = re.compile(r"but got (<class '[^']+'>)")
_REASON = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


def refusal(path: str | Path, what: str, exc: BaseException) -> pickle.UnpicklingError:
    """The error for a file that the restricted unpickler refused."""
    text = str(exc)
    if found := _GLOBAL.search(text):
        reason = f"it names {found.group(1)}, which is not allowed"
    elif found := _BUILT.search(text):
        reason = f"it builds {found.group(1)}, which is not allowed"
    elif found := _REASON.search(text):
        reason = found.group(1).strip()
    else:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        reason = lines[0] if lines else type(exc).__name__
    return pickle.UnpicklingError(
        f"{path}: refused to load it as {what}: it is unsafe (it asks the unpickler for more "
        f"than tensors, plain values and the allowed numpy RNG types; {reason}). Nothing in it "
        "was run. Checkpoint files are only ever written by the group itself: remove this "
        "file, or load a checkpoint written by a TrainerGroup"
    )


def load_state(path: str | Path, *, what: str, map_location: Any = "cpu") -> Any:
    """``torch.load`` of ``path`` with ``weights_only=True`` and :data:`SAFE_GLOBALS` only.

    ``what`` names the expected content in the error (``"a checkpoint shard"``). Raises
    :class:`pickle.UnpicklingError` naming ``path`` when the file is refused as unsafe."""
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refusal(path, what, exc) from None
