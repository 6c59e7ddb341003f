"""verl's ``verl.utils.tensordict_utils`` helpers, for workers ported by changing imports.

    # import verl.utils.tensordict_utils as tu   (or: from verl.utils import tensordict_utils)
    import tgruntime.compat.verl.utils.tensordict_utils as tu

The helpers keep verl's meanings: non-tensor values live in a TensorDict as
``NonTensorData`` (one value for the whole batch) or ``NonTensorStack`` (one value per
row, built from a list); ``get``/``pop`` hand them back as plain Python values.
"""

# TensorDict refuses ``key in td`` (membership is ambiguous there): ``.keys()`` is needed.
# ruff: noqa: SIM118

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

from tgruntime.controller.dataproto import concat_tensordicts

__all__ = [
    "assign_non_tensor",
    "assign_non_tensor_data",
    "assign_non_tensor_stack",
    "chunk_tensordict",
    "concat_tensordict",
    "contiguous",
    "get",
    "get_keys",
    "get_non_tensor_data",
    "get_tensordict",
    "index_select_tensor_dict",
    "pad_to_divisor",
    "pop",
    "pop_keys",
    "union_tensor_dict",
    "unpad",
    "unwrap_non_tensor_data",
]

log = logging.getLogger("tgruntime.compat.verl")


def _require_td(value: Any) -> None:
    if not isinstance(value, TensorDict):
        raise TypeError(f"expected a TensorDict, got {type(value).__name__}")


def _stack(values: Sequence[Any]) -> NonTensorStack:
    items: list[Any] = [NonTensorData(v) for v in values]
    return NonTensorStack.from_list(items)


def _native(value: Any) -> Any:
    """A stored value as verl's get/pop return it: tensors as is, non-tensors unwrapped."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, NonTensorStack):
        return value.tolist()
    if isinstance(value, NonTensorData):
        return value.data
    return value


# ---------------------------------------------------------------------------- building
def assign_non_tensor_data(tensor_dict: TensorDict, key: str, val: Any) -> None:
    """Store one value for the whole batch under ``key``."""
    _require_td(tensor_dict)
    tensor_dict[key] = NonTensorData(val)


def assign_non_tensor_stack(tensor_dict: TensorDict, key: str, val: list[Any]) -> None:
    """Store a list (one, possibly nested, value per row) under ``key``."""
    _require_td(tensor_dict)
    tensor_dict[key] = _stack(val)


def assign_non_tensor(tensor_dict: TensorDict, **kwargs: Any) -> TensorDict:
    """Lists become per-row stacks, anything else a batch-wide value."""
    _require_td(tensor_dict)
    for key, val in kwargs.items():
        if isinstance(val, NonTensorData | NonTensorStack):
            tensor_dict[key] = val
        elif isinstance(val, list):
            assign_non_tensor_stack(tensor_dict, key, val)
        else:
            assign_non_tensor_data(tensor_dict, key, val)
    return tensor_dict


def unwrap_non_tensor_data(data: Any) -> Any:
    return data.data if isinstance(data, NonTensorData) else data


def get_non_tensor_data(data: TensorDict, key: str, default: Any) -> Any:
    return unwrap_non_tensor_data(data.get(key, default))


def get_tensordict(
    tensor_dict: Mapping[str, torch.Tensor | list[Any] | NonTensorStack],
    non_tensor_dict: Mapping[str, Any] | None = None,
) -> TensorDict:
    """A TensorDict of per-row values (tensors, lists) and batch-wide values (``non_tensor_dict``).

    All per-row values must have the same length; that length is the batch size (none
    when there are no per-row values).
    """
    source: dict[str, Any] = {}
    batch: int | None = None
    stored: Any
    for key, val in tensor_dict.items():
        if isinstance(val, list):
            if any(isinstance(v, torch.Tensor) for v in val):
                raise TypeError(
                    f"{key!r}: a list becomes a NonTensorStack, which cannot hold tensors"
                )
            size, stored = len(val), _stack(val)
        elif isinstance(val, NonTensorStack):
            size, stored = len(val), val
        elif isinstance(val, torch.Tensor):
            size, stored = int(val.shape[0]), val
        else:
            raise TypeError(f"{key!r}: expected a tensor or a list, got {type(val).__name__}")
        if batch is None:
            batch = size
        elif size != batch:
            raise ValueError(f"{key!r} has {size} rows, expected {batch}")
        source[key] = stored
    for key, val in (non_tensor_dict or {}).items():
        if key in source:
            raise ValueError(f"{key!r} is given both per row and for the whole batch")
        source[key] = NonTensorData(val)
    return TensorDict(source, batch_size=[] if batch is None else [batch])


# ---------------------------------------------------------------------------- access
def get(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """The value under ``key`` (tensor, list or plain value), or ``default``."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.get(key))


def pop(tensordict: TensorDict, key: str, default: Any = None) -> Any:
    """Remove ``key`` and return its value as ``get`` would, or ``default``."""
    if key not in tensordict.keys():
        return default
    return _native(tensordict.pop(key))


def _subset(tensordict: TensorDict, keys: Iterable[str], remove: bool) -> TensorDict:
    per_row: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    for key in keys:
        if key not in tensordict.keys():
            raise KeyError(f"key {key} not in tensordict")
        val = tensordict.pop(key) if remove else tensordict.get(key)
        if isinstance(val, NonTensorData):
            whole[key] = val.data
        else:
            per_row[key] = _native(val)
    return get_tensordict(per_row, whole)


def get_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """A new TensorDict with only ``keys`` (KeyError if one is missing)."""
    return _subset(tensordict, keys, remove=False)


def pop_keys(tensordict: TensorDict, keys: Iterable[str]) -> TensorDict:
    """Remove ``keys`` and return them as a new TensorDict (KeyError if one is missing)."""
    return _subset(tensordict, keys, remove=True)


def contiguous(data: TensorDict) -> TensorDict:
    """A new TensorDict with contiguous tensors; non-tensor values kept as they are."""
    per_row: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    for raw_key in data.keys():
        key = str(raw_key)  # top-level keys of a flat TensorDict are strings
        val = data.get(raw_key)
        if isinstance(val, NonTensorData):
            whole[key] = val.data
        elif isinstance(val, NonTensorStack):
            per_row[key] = val
        elif isinstance(val, torch.Tensor):
            per_row[key] = val.contiguous()
        else:
            raise TypeError(
                f"{key!r}: expected a tensor or non-tensor data, got {type(val).__name__}"
            )
    return get_tensordict(per_row, whole)


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` (in place); shared keys must be equal."""
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"batch sizes differ: {tensor_dict1.batch_size} and {tensor_dict2.batch_size}"
        )
    for key in tensor_dict2.keys():
        if key not in tensor_dict1.keys():
            tensor_dict1[key] = tensor_dict2.get(key)
            continue
        a, b = tensor_dict1.get(key), tensor_dict2.get(key)
        same = (
            a.equal(b)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            else _native(a) == _native(b)
        )
        if not same:
            raise ValueError(f"{key!r} differs between the two TensorDicts")
    return tensor_dict1


# ---------------------------------------------------------------------------- batch ops
def index_select_tensor_dict(
    batch: TensorDict, indices: torch.Tensor | Sequence[int]
) -> TensorDict:
    index = (
        indices
        if isinstance(indices, torch.Tensor)
        else torch.as_tensor(list(indices), dtype=torch.long)
    )
    return batch[index]


def chunk_tensordict(td: TensorDict, chunks: int) -> list[TensorDict]:
    if len(td) % chunks:
        raise ValueError(f"{len(td)} rows cannot be split into {chunks} equal chunks")
    return list(td.chunk(chunks, dim=0))


def concat_tensordict(data: Sequence[TensorDict]) -> TensorDict:
    """Join along dim 0; TensorDicts without a batch dimension give the first (verl's rule).

    The same function joins TensorDict results of N-D / DP_COMPUTE_PROTO calls.
    """
    if not data:
        raise ValueError("nothing to concatenate")
    return concat_tensordicts(data)


def pad_to_divisor(data: TensorDict, size_divisor: int) -> tuple[TensorDict, int]:
    """(padded, pad size): rows repeated from the start so the length divides ``size_divisor``."""
    _require_td(data)
    n = len(data)
    pad = (-n) % size_divisor if n else 0
    if n == 0:
        log.warning("padding an empty TensorDict: unchanged")
    if pad == 0:
        return data, 0
    index = torch.arange(pad) % n
    return cast(TensorDict, torch.cat([data, data[index]], dim=0)), pad


def unpad(data: TensorDict, pad_size: int) -> TensorDict:
    return data[: len(data) - pad_size] if pad_size else data
