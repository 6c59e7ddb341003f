"""Tensors <-> numpy arrays for transport through Ray's object store.

Ray moves numpy arrays out of band (pickle protocol 5): one copy into shared memory,
none on the way out. A pickled torch tensor instead goes through ``torch.save`` into
an in-band byte string, ~40x slower for a 256 MB batch. So a DataProto encodes each
tensor as a numpy array that *shares* the tensor's memory (no copy for contiguous CPU
tensors) and decodes it with ``torch.from_numpy`` (no copy either).

dtypes numpy lacks (bfloat16, float8 variants, ...) travel as a same-width integer view
and are viewed back on arrival. Tensors numpy cannot describe at all (sparse, nested,
quantized) fall back to ordinary pickling.

Received tensors share memory with Ray's object store, which is read-only by contract
(as for numpy arrays Ray returns): code that must modify its input in place calls
``DataProto.clone()`` first. ``set_copy_on_receive(True)`` or the environment variable
``TG_DATAPROTO_COPY=1`` makes every arrival a private copy instead (measured: a copy into
fresh memory costs more than the whole transfer on this machine, hence the default).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_state = {"copy": os.environ.get("TG_DATAPROTO_COPY", "0").lower() in ("1", "true", "yes")}


def copy_on_receive() -> bool:
    """Whether decoded tensors are private copies (True) or views of the object store."""
    return _state["copy"]


def set_copy_on_receive(enabled: bool) -> None:
    """Choose copy-on-arrival (safe to modify in place) or zero-copy (read-only by contract)."""
    _state["copy"] = bool(enabled)


@dataclass(frozen=True)
class EncodedTensor:
    """A tensor as a numpy array plus the torch dtype to view it back as (if different)."""

    array: Any  # np.ndarray, or a torch.Tensor when numpy cannot hold it
    torch_dtype: str | None  # e.g. "bfloat16" when the array is an int16 view

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (EncodedTensor, (self.array, self.torch_dtype))


def encode(tensor: torch.Tensor) -> EncodedTensor:
    """Encode a tensor without copying when it is a contiguous CPU tensor."""
    t = tensor.detach()
    if t.layout is not torch.strided or t.is_quantized or getattr(t, "is_nested", False):
        return EncodedTensor(t.cpu(), None)
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    try:
        return EncodedTensor(t.numpy(), None)
    except (TypeError, RuntimeError):
        pass
    view_dtype = _INT_VIEW.get(t.element_size())
    if view_dtype is None:
        return EncodedTensor(t, None)
    return EncodedTensor(t.view(view_dtype).numpy(), str(t.dtype).removeprefix("torch."))


def decode(encoded: EncodedTensor, *, copy: bool | None = None) -> torch.Tensor:
    """Turn an encoded tensor back into a tensor (sharing memory unless ``copy``)."""
    arr = encoded.array
    if isinstance(arr, torch.Tensor):
        return arr
    do_copy = copy_on_receive() if copy is None else copy
    if do_copy:
        tensor = torch.from_numpy(np.array(arr, copy=True, order="C"))
    elif not arr.flags.writeable:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(arr)
    else:
        tensor = torch.from_numpy(arr)
    if encoded.torch_dtype is not None:
        tensor = tensor.view(getattr(torch, encoded.torch_dtype))
    return tensor
