"""verl's ``verl.utils.tensordict_utils`` helpers, for workers ported by changing imports.

    # import verl.utils.tensordict_utils as tu   (or: from verl.utils import tensordict_utils)
    import tgruntime.compat.verl.utils.tensordict_utils as tu

The helpers keep verl's meanings: non-tensor values live in a TensorDict as
``NonTensorData`` (one value for the whole batch) or ``NonTensorStack`` (one value per
row, built from a list); ``get``/``pop`` hand them back as plain Python values.

Variable-length rows are jagged nested tensors (``torch.nested``, ``layout=torch.jagged``):
``nested_tensor_from_tensor_list`` builds one from per-row tensors, ``concat_nested_tensors``
and ``concat_tensordict`` join them, ``list_of_dict_to_tensordict`` makes one for a key whose
rows differ in length. Where verl's helpers assert (``concat_nested_tensors``,
``concat_tensordict_with_none_bsz``, ``make_iterator``, ``assert_tensordict_eq``) these raise
``AssertionError`` too, with the offending key or shape, whatever ``python -O`` says.
"""

# TensorDict refuses ``key in td`` (membership is ambiguous there): ``.keys()`` is needed.
# ruff: noqa: SIM118

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from tensordict import TensorDict
from tensordict.tensorclass import NonTensorData, NonTensorStack

from tgruntime.controller.dataproto import concat_tensordicts

__all__ = [
    "assert_tensordict_eq",
    "assign_non_tensor",
    "assign_non_tensor_data",
    "assign_non_tensor_stack",
    "chunk_tensordict",
    "concat_nested_tensors",
    "concat_tensordict",
    "concat_tensordict_with_none_bsz",
    "contiguous",
    "get",
    "get_keys",
    "get_non_tensor_data",
    "get_tensordict",
    "index_select_tensor_dict",
    "list_of_dict_to_tensordict",
    "make_iterator",
    "maybe_fix_3d_position_ids",
    "nested_tensor_from_tensor_list",
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


def _nested_keys(td: TensorDict) -> set[str]:
    return {
        str(k) for k in td.keys() if isinstance(v := td.get(k), torch.Tensor) and v.is_nested
    }


def concat_tensordict(data: Sequence[TensorDict]) -> TensorDict:
    """Join along dim 0; TensorDicts without a batch dimension give the first (verl's rule).

    Jagged nested tensors are joined with :func:`concat_nested_tensors`; every TensorDict must
    then hold the same nested keys. The same function joins TensorDict results of N-D /
    DP_COMPUTE_PROTO calls.
    """
    if not data:
        raise ValueError("nothing to concatenate")
    nested = _nested_keys(data[0])
    if not nested:
        return concat_tensordicts(data)
    plain: list[TensorDict] = []
    for i, td in enumerate(data):
        if _nested_keys(td) != nested:
            raise AssertionError(
                f"TensorDict {i} has nested tensors {sorted(_nested_keys(td))}, the first has "
                f"{sorted(nested)}: all must have the same set of nested tensors"
            )
        rest = {str(k): td.get(k) for k in td.keys() if str(k) not in nested}
        plain.append(TensorDict(rest, batch_size=td.batch_size, device=td.device))
    out = concat_tensordicts(plain)
    for key in sorted(nested):
        out[key] = concat_nested_tensors([td.get(key) for td in data])
    return out


def concat_tensordict_with_none_bsz(data: Sequence[TensorDict]) -> TensorDict:
    """The first of TensorDicts that have no batch dimension (batch-wide values only).

    Such TensorDicts carry one value per key for the whole batch (``NonTensorData``
    metadata), so joining them keeps the first; one with a batch dimension is an error.
    """
    if not data:
        raise AssertionError("nothing to concatenate")
    for i, td in enumerate(data):
        if len(td.batch_size) != 0:
            raise AssertionError(
                f"TensorDict {i} has batch size {list(td.batch_size)}: only TensorDicts without "
                "a batch dimension (batch_size=[]) are joined by keeping the first"
            )
    return data[0]


# ---------------------------------------------------------------------------- nested tensors
def nested_tensor_from_tensor_list(
    tensors: Sequence[torch.Tensor], ragged_idx: int | None = None
) -> torch.Tensor:
    """A jagged nested tensor whose rows are ``tensors`` (all of the same number of dims).

    ``ragged_idx`` is the nested tensor's ragged dimension (1 .. the rows' dims; dimension 0
    is the batch), by default the rows' last dimension: rows of shape ``(4, L_i)`` give a
    ``[B, 4, j]`` tensor with ``ragged_idx`` 2. The rows may differ only along that dimension.
    """
    rows = list(tensors)
    if not rows:
        raise AssertionError("nested_tensor_from_tensor_list needs at least one tensor")
    dims = rows[0].dim()
    if dims < 1 or any(t.dim() != dims for t in rows):
        raise AssertionError(
            f"the rows must have the same number (>= 1) of dims, got {[t.dim() for t in rows]}"
        )
    ragged = dims if ragged_idx is None else int(ragged_idx)
    if not 1 <= ragged <= dims:
        raise AssertionError(f"ragged_idx must be in [1, {dims}], got {ragged_idx}")
    if dims == 1:
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    along = ragged - 1  # the rows' own dimension that varies
    lengths = torch.tensor([t.shape[along] for t in rows], dtype=torch.long)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, dim=0)
    values = torch.cat(rows, dim=along)
    return torch.nested.nested_tensor_from_jagged(
        values, offsets.to(values.device), jagged_dim=ragged
    )


def concat_nested_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join jagged nested tensors along the batch: the rows of each, in order.

    Each must be a contiguous nested tensor of 2 or more dims (batch + ragged); the result
    keeps the first one's ragged dimension.
    """
    parts = list(tensors)
    if not parts:
        raise AssertionError("nothing to concatenate")
    rows: list[torch.Tensor] = []
    for i, t in enumerate(parts):
        if not (isinstance(t, torch.Tensor) and t.is_nested):
            raise AssertionError(f"tensor {i} is not a nested tensor")
        if not t.is_contiguous():
            raise AssertionError(f"nested tensor {i} is not contiguous")
        if t.dim() < 2:
            raise AssertionError(f"nested tensor {i} must have 2 or more dims, got {t.shape}")
        rows.extend(_rows(t))
    return nested_tensor_from_tensor_list(rows, ragged_idx=_ragged_idx(parts[0]))


def _ragged_idx(t: torch.Tensor) -> int:
    return int(getattr(t, "_ragged_idx", t.dim() - 1))


def _rows(t: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a jagged nested tensor, read from its values and offsets (``unbind`` of
    3-D+ jagged tensors splits the wrong dimension in some torch versions)."""
    ragged = _ragged_idx(t)
    values, offsets = t.values(), t.offsets().tolist()  # type: ignore[attr-defined]
    along = ragged - 1
    return [
        values.narrow(along, start, end - start)
        for start, end in itertools.pairwise(offsets)
    ]


def maybe_fix_3d_position_ids(data: TensorDict) -> None:
    """Set the ragged dimension of a 3-D nested ``position_ids`` (a VLM's ``[B, 4, j]``) back
    to 2, in place; a pickled and consolidated TensorDict can lose it. Anything else: no-op."""
    if "position_ids" not in data.keys():
        return
    pos = data.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.is_nested and pos.dim() == 3:
        pos._ragged_idx = 2  # type: ignore[attr-defined]


def list_of_dict_to_tensordict(list_of_dicts: Sequence[Mapping[str, Any]]) -> TensorDict:
    """A TensorDict of one row per dict (the keys of the first dict; each dict must have them).

    Per key: tensors of one shape are stacked; tensors of different shapes become a jagged
    nested tensor; anything else (numbers, strings, lists, dicts, or a mix) a per-row
    ``NonTensorStack``.
    """
    dicts = list(list_of_dicts)
    if not dicts:
        raise AssertionError("list_of_dict_to_tensordict needs at least one dict")
    source: dict[str, Any] = {}
    for key in dicts[0].keys():
        values = [d[key] for d in dicts]
        if all(isinstance(v, torch.Tensor) for v in values):
            if all(v.shape == values[0].shape for v in values):
                source[key] = torch.stack(values)
            else:
                source[key] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
        else:
            source[key] = _stack(values)
    return TensorDict(source, batch_size=[len(dicts)])


# ---------------------------------------------------------------------------- iteration
def make_iterator(
    tensordict: TensorDict,
    mini_batch_size: int,
    epochs: int,
    seed: int | None = None,
    dataloader_kwargs: Mapping[str, Any] | None = None,
) -> Iterator[TensorDict]:
    """Mini-batches of ``mini_batch_size`` rows, ``epochs`` passes over ``tensordict``.

    The rows are drawn by a ``torch.utils.data.DataLoader`` over the row indices, so
    ``dataloader_kwargs`` (``shuffle=True``, ``drop_last``...) apply; ``seed`` seeds its
    generator, so shuffled orders repeat for one seed. The batch size must be a multiple of
    ``mini_batch_size``.
    """
    from torch.utils.data import DataLoader

    rows = int(tensordict.batch_size[0])
    if mini_batch_size <= 0 or rows % mini_batch_size:
        raise AssertionError(f"{rows} rows are not a multiple of mini_batch_size {mini_batch_size}")
    if dataloader_kwargs is not None and not isinstance(dataloader_kwargs, Mapping):
        raise AssertionError(
            f"dataloader_kwargs must be a dict, got {type(dataloader_kwargs).__name__}"
        )
    generator = None
    if seed is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
    loader: DataLoader[torch.Tensor] = DataLoader(
        torch.arange(rows),  # type: ignore[arg-type]  # a tensor is an index-able dataset
        batch_size=mini_batch_size,
        collate_fn=torch.stack,
        generator=generator,
        **dict(dataloader_kwargs or {}),
    )

    def batches() -> Iterator[TensorDict]:
        for _ in range(epochs):
            for index in loader:
                yield index_select_tensor_dict(tensordict, index)

    return batches()


# ---------------------------------------------------------------------------- comparison
def assert_tensordict_eq(tensordict1: TensorDict, tensordict2: TensorDict) -> None:
    """Raise ``AssertionError`` unless both hold the same keys with equal values.

    Tensors must match in shape and every element; nested tensors row by row; non-tensor
    values (``NonTensorData``, ``NonTensorStack``) by ``==`` on their Python values; nested
    TensorDicts key by key. The message names the first key that differs.
    """
    keys1 = {str(k) for k in tensordict1.keys()}
    keys2 = {str(k) for k in tensordict2.keys()}
    if keys1 != keys2:
        raise AssertionError(
            f"the keys differ: only in the first {sorted(keys1 - keys2)}, "
            f"only in the second {sorted(keys2 - keys1)}"
        )
    for key in sorted(keys1):
        a, b = tensordict1.get(key), tensordict2.get(key)
        if type(a) is not type(b):
            raise AssertionError(
                f"{key!r}: the types differ: {type(a).__name__} and {type(b).__name__}"
            )
        if isinstance(a, TensorDict):
            assert_tensordict_eq(a, b)
        elif isinstance(a, torch.Tensor):
            if a.is_nested or b.is_nested:
                if not (a.is_nested and b.is_nested):
                    raise AssertionError(f"{key!r}: only one of the two is a nested tensor")
                ra, rb = list(a.unbind()), list(b.unbind())
                if len(ra) != len(rb):
                    raise AssertionError(f"{key!r}: {len(ra)} and {len(rb)} nested rows")
                for i, (x, y) in enumerate(zip(ra, rb, strict=True)):
                    if not torch.equal(x, y):
                        raise AssertionError(f"{key!r}: nested row {i} differs: {x} and {y}")
            elif a.shape != b.shape or not torch.equal(a, b):
                raise AssertionError(f"{key!r}: the tensors differ: {a} and {b}")
        elif _native(a) != _native(b):
            raise AssertionError(f"{key!r}: the values differ: {_native(a)!r} and {_native(b)!r}")


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
