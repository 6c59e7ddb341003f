"""Dispatch and collect functions: pure logic, no Ray calls.

A dispatch function turns a group call's arguments into per-rank argument lists:
``(args, kwargs) -> (tuple of lists, dict of lists)``, each list holding one value per
rank. A collect function turns the per-rank outputs (values, or ``ObjectRef``s when the
call is non-blocking) into the call's result. Both take the group first, as in verl;
the group only needs ``world_size`` and, for mesh dispatch, the mesh tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from tgruntime.controller.futures import DataProtoFuture, is_object_ref
from tgruntime.controller.modes import TRIM_KWARG, Dispatch
from tgruntime.controller.partition import chunk_lengths, is_dataproto, is_tensordict

if TYPE_CHECKING:
    from tgruntime.controller.dataproto import DataProto

PerRank = tuple[tuple[list[Any], ...], dict[str, list[Any]]]
Trim = tuple[int, int] | None


class DispatchTarget(Protocol):
    """What dispatch/collect functions need from a group."""

    @property
    def world_size(self) -> int: ...

    def mesh_dispatch_info(self, mesh_name: str) -> list[int]: ...

    def mesh_collect_info(self, mesh_name: str) -> list[bool]: ...


# --------------------------------------------------------------------------- splitting
def split_proto(data: DataProto, parts: int) -> tuple[list[DataProto], list[Trim]]:
    """Split into ``parts`` equal parts, padding the tail parts with rows from the start.

    Returns the parts and, per part, ``(real rows, padded rows)`` when it was padded.
    Unpadded parts are views of ``data``; only padded parts copy (their own rows).
    """
    from tgruntime.controller.dataproto import DataProto

    n = len(data)
    real, pad = chunk_lengths(n, parts)
    out: list[DataProto] = []
    trims: list[Trim] = []
    offset = 0
    for r, p in zip(real, pad, strict=True):
        piece = data.slice(offset, offset + r)
        offset += r
        if p and n:
            padding = data.select_idxs(np.arange(p) % n)
            piece = DataProto.concat([piece, padding]) if r else padding
            trims.append((r, r + p))
        else:
            trims.append(None)
        out.append(piece)
    return out, trims


def _split_many(
    parts: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[list[Any] | None], dict[str, list[Any] | None], list[Trim]]:
    """Split every DataProto, TensorDict (or DataProtoFuture) argument into ``parts`` parts.

    Other arguments map to None (the caller broadcasts them), and so do TensorDicts without
    a batch dimension (batch-wide values only). All split arguments must have the same
    length.
    """
    length: int | None = None
    trims: list[Trim] = [None] * parts

    def one(value: Any) -> list[Any] | None:
        nonlocal length, trims
        if isinstance(value, DataProtoFuture):
            if value.num_parts == parts and value.select is None:
                return list(value.refs)  # already one part per slot: pass straight through
            value = value.get()
        rows: int | None
        if is_dataproto(value):
            rows = len(value)
        elif is_tensordict(value):
            from tgruntime.controller.dataproto import tensordict_rows

            rows = tensordict_rows(value)
            if rows is None:
                return None
        else:
            return None
        if length is None:
            length = rows
        elif rows != length:
            raise ValueError(
                "all DataProto/TensorDict arguments of a DP call must have the same length, got "
                f"{length} and {rows}"
            )
        if is_dataproto(value):
            pieces, t = split_proto(value, parts)
        else:
            from tgruntime.controller.dataproto import split_tensordict

            tds, t = split_tensordict(value, parts)
            pieces = list(tds)
        trims = t
        return list(pieces)

    split_args = [one(a) for a in args]
    split_kwargs = {k: one(v) for k, v in kwargs.items()}
    return split_args, split_kwargs, trims


# --------------------------------------------------------------------------- built-ins
def dispatch_one_to_all(group: DispatchTarget, *args: Any, **kwargs: Any) -> PerRank:
    n = group.world_size
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(group: DispatchTarget, *args: Any, **kwargs: Any) -> PerRank:
    """verl's rule: lists of world_size values are scattered, anything else is broadcast."""
    return normalize(group, args, kwargs)


def collect_all_to_all(group: DispatchTarget, outputs: Sequence[Any]) -> list[Any]:
    return list(outputs)


def dispatch_rank_zero(group: DispatchTarget, *args: Any, **kwargs: Any) -> PerRank:
    return tuple([a] for a in args), {k: [v] for k, v in kwargs.items()}


def collect_rank_zero(group: DispatchTarget, outputs: Any) -> Any:
    return outputs[0] if isinstance(outputs, list) and len(outputs) == 1 else outputs


def dispatch_dp_compute(group: DispatchTarget, *args: Any, **kwargs: Any) -> PerRank:
    n = group.world_size
    for i, a in enumerate(args):
        _check_per_rank(a, n, f"positional argument {i}")
    for k, v in kwargs.items():
        _check_per_rank(v, n, f"argument {k!r}")
    return tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()}


def collect_dp_compute(group: DispatchTarget, outputs: Sequence[Any]) -> list[Any]:
    if len(outputs) != group.world_size:
        raise ValueError(f"expected {group.world_size} outputs, got {len(outputs)}")
    return list(outputs)


def dispatch_dp_compute_data_proto(group: DispatchTarget, *args: Any, **kwargs: Any) -> PerRank:
    """Chunk every DataProto argument over the ranks (padding if uneven); broadcast the rest."""
    n = group.world_size
    split_args, split_kwargs, trims = _split_many(n, args, kwargs)
    out_args = tuple(s if s is not None else [a] * n for s, a in zip(split_args, args, strict=True))
    out_kwargs = {k: (s if s is not None else [kwargs[k]] * n) for k, s in split_kwargs.items()}
    if any(t is not None for t in trims):
        out_kwargs[TRIM_KWARG] = list(trims)
    return out_args, out_kwargs


def dispatch_dp_compute_data_proto_with_func(
    group: DispatchTarget, func: Callable[..., Any], *args: Any, **kwargs: Any
) -> PerRank:
    """The first argument (a function) is broadcast; the rest as DP_COMPUTE_PROTO."""
    out_args, out_kwargs = dispatch_dp_compute_data_proto(group, *args, **kwargs)
    return ([func] * group.world_size, *out_args), out_kwargs


def collect_dp_compute_data_proto(group: DispatchTarget, outputs: Sequence[Any]) -> Any:
    return concat_outputs(collect_dp_compute(group, outputs))


# --------------------------------------------------------------------------- mesh (N-D)
def dispatch_nd_proto(mesh_name: str, group: DispatchTarget, *args: Any, **kwargs: Any) -> PerRank:
    """Split DataProto arguments into dp_size parts; every rank gets its dp rank's part."""
    mapping = group.mesh_dispatch_info(mesh_name)
    dp_size = _dp_size(mesh_name, mapping)
    split_args, split_kwargs, trims = _split_many(dp_size, args, kwargs)
    n = group.world_size

    def per_rank(parts: list[Any] | None, original: Any) -> list[Any]:
        return [original] * n if parts is None else [parts[mapping[r]] for r in range(n)]

    out_args = tuple(per_rank(s, a) for s, a in zip(split_args, args, strict=True))
    out_kwargs = {k: per_rank(s, kwargs[k]) for k, s in split_kwargs.items()}
    if any(t is not None for t in trims):
        out_kwargs[TRIM_KWARG] = [trims[mapping[r]] for r in range(n)]
    return out_args, out_kwargs


def collect_nd_proto(mesh_name: str, group: DispatchTarget, outputs: Sequence[Any]) -> Any:
    """Concatenate the outputs of the ranks marked ``is_collect``, in dp-rank order."""
    mapping = group.mesh_dispatch_info(mesh_name)
    mask = group.mesh_collect_info(mesh_name)
    dp_size = _dp_size(mesh_name, mapping)
    chosen = sorted((mapping[r], r) for r in range(group.world_size) if mask[r])
    dp_ranks = [dp for dp, _ in chosen]
    if dp_ranks != list(range(dp_size)):
        raise ValueError(
            f"mesh {mesh_name!r}: exactly one rank per dp rank must be marked is_collect; "
            f"marked ranks cover dp ranks {dp_ranks}, expected {list(range(dp_size))}"
        )
    return concat_outputs([outputs[r] for _, r in chosen])


def _dp_size(mesh_name: str, mapping: Sequence[int]) -> int:
    if not mapping:
        raise ValueError(f"mesh {mesh_name!r} has no dispatch info")
    dp_size = max(mapping) + 1
    missing = sorted(set(range(dp_size)) - set(mapping))
    if missing:
        raise ValueError(f"mesh {mesh_name!r}: no rank registered dp ranks {missing}")
    return dp_size


# --------------------------------------------------------------------------- helpers
def concat_outputs(outputs: Sequence[Any]) -> Any:
    """DataProto.concat (or verl's concat_tensordict) of values, or a DataProtoFuture over
    references."""
    outputs = list(outputs)
    if outputs and all(is_object_ref(o) for o in outputs):
        return DataProtoFuture(outputs)
    if any(is_object_ref(o) for o in outputs):
        raise TypeError("cannot mix ObjectRefs and values in a DataProto collect")
    if outputs and all(is_tensordict(o) for o in outputs):
        from tgruntime.controller.dataproto import concat_tensordicts

        return concat_tensordicts(outputs)
    bad = [type(o).__name__ for o in outputs if not is_dataproto(o)]
    if bad or not outputs:
        raise TypeError(
            "a DataProto collect needs every worker to return a DataProto (or every worker a "
            f"TensorDict), got {[type(o).__name__ for o in outputs]}"
        )
    return type(outputs[0]).concat(outputs)


def normalize(group: DispatchTarget, args: Sequence[Any], kwargs: dict[str, Any]) -> PerRank:
    """Per-rank lists from (args, kwargs): scatter if all are world-size lists, else broadcast."""
    n = group.world_size
    values = [*args, *kwargs.values()]
    if values and all(isinstance(v, list | tuple) and len(v) == n for v in values):
        return tuple(list(a) for a in args), {k: list(v) for k, v in kwargs.items()}
    return tuple([a] * n for a in args), {k: [v] * n for k, v in kwargs.items()}


def _check_per_rank(value: Any, n: int, what: str) -> None:
    if not isinstance(value, list | tuple) or len(value) != n:
        got = (
            f"a {type(value).__name__} of length {len(value)}"
            if isinstance(value, list | tuple)
            else type(value).__name__
        )
        raise ValueError(
            f"DP_COMPUTE needs {what} as a list of {n} values (one per rank), got {got}"
        )


BUILTIN: dict[Dispatch, tuple[Callable[..., PerRank], Callable[..., Any]]] = {
    Dispatch.RANK_ZERO: (dispatch_rank_zero, collect_rank_zero),
    Dispatch.ONE_TO_ALL: (dispatch_one_to_all, collect_all_to_all),
    Dispatch.ALL_TO_ALL: (dispatch_all_to_all, collect_all_to_all),
    Dispatch.DP_COMPUTE: (dispatch_dp_compute, collect_dp_compute),
    Dispatch.DP_COMPUTE_PROTO: (dispatch_dp_compute_data_proto, collect_dp_compute_data_proto),
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: (
        dispatch_dp_compute_data_proto_with_func,
        collect_dp_compute_data_proto,
    ),
    Dispatch.DP_COMPUTE_METRIC: (dispatch_dp_compute_data_proto, collect_dp_compute),
}
