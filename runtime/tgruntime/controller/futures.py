"""DataProtoFuture: the result of a non-blocking DataProto call, not yet fetched.

It holds one ``ObjectRef`` per part (one per collected worker); the parts are DataProtos,
or TensorDicts (joined with verl's ``concat_tensordict`` rule). Passed to another
group's DP method with as many workers as parts, each part's reference goes straight to
the matching worker: the data moves worker to worker and never through the controller.
Otherwise ``get()`` fetches and concatenates the parts (on the controller, or inside a
worker when the future is an argument of a registered method).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from tgruntime.controller.partition import is_tensordict

if TYPE_CHECKING:
    from tensordict import TensorDict

    from tgruntime.controller.calls import CallContext
    from tgruntime.controller.dataproto import DataProto


def is_object_ref(value: Any) -> bool:
    return isinstance(value, ray.ObjectRef)


class DataProtoFuture:
    """Lazy concatenation of DataProto parts living in Ray's object store."""

    def __init__(
        self,
        refs: Sequence[Any],
        *,
        ctx: CallContext | None = None,
        select: tuple[int, int] | None = None,
    ) -> None:
        self.refs: list[Any] = list(refs)
        self.ctx = ctx
        self.select = select  # (index, parts): this future is one of ``parts`` chunks
        # the whole call (every rank's result and context) when only some ranks' results
        # are collected: a collected rank's error caused by an uncollected rank's death is
        # reported as that death (calls.died_peer)
        self.call: tuple[tuple[Any, ...], CallContext] | None = None

    @property
    def num_parts(self) -> int:
        return len(self.refs)

    @classmethod
    def concat(cls, refs: Sequence[Any]) -> DataProtoFuture:
        """verl's name: a future over ``refs`` whose value is their concatenation."""
        return cls(refs)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, the i-th resolving to the i-th chunk of this one's value."""
        if self.select is not None:
            raise ValueError("cannot chunk a future that is already a chunk")
        out = [DataProtoFuture(self.refs, ctx=self.ctx, select=(i, chunks)) for i in range(chunks)]
        for f in out:
            f.call = self.call
        return out

    def get(self, timeout_s: float | None = None) -> DataProto | TensorDict:
        """Fetch, concatenate (and select a chunk of) the parts."""
        from tgruntime.controller.calls import died_peer, mark_retrieved, resolve
        from tgruntime.controller.dataproto import (
            DataProto,
            chunk_lengths,
            concat_tensordicts,
            tensordict_rows,
        )
        from tgruntime.controller.errors import WorkerMethodError

        if self.ctx is not None and len(self.ctx.ranks) == len(self.refs):
            try:
                values = resolve(self.refs, self.ctx, timeout_s=timeout_s)
            except WorkerMethodError as exc:
                died = died_peer(*self.call) if self.call is not None else None
                if died is None:
                    raise
                mark_retrieved(self.call[0] if self.call is not None else ())
                raise died from exc
        else:
            try:
                values = list(ray.get(self.refs, timeout=timeout_s))
            except RayError as exc:
                if not isinstance(exc, GetTimeoutError):
                    mark_retrieved(self.refs)  # the other parts' errors: not "unhandled"
                raise
        if values and all(is_tensordict(v) for v in values):
            td = concat_tensordicts(values)
            rows = tensordict_rows(td)
            if self.select is None or rows is None:
                return td
            index, parts = self.select
            real, _ = chunk_lengths(rows, parts)
            start = sum(real[:index])
            return td[start : start + real[index]]
        if not all(isinstance(v, DataProto) for v in values):
            raise TypeError(
                "DataProtoFuture parts must all be DataProto or all TensorDict, got "
                f"{[type(v).__name__ for v in values]}"
            )
        data = values[0] if len(values) == 1 else DataProto.concat(values)
        if self.select is None:
            return data
        index, parts = self.select
        real, _ = chunk_lengths(len(data), parts)
        start = sum(real[:index])
        return data.slice(start, start + real[index])

    def __repr__(self) -> str:
        sel = f", chunk={self.select[0]}/{self.select[1]}" if self.select else ""
        return f"DataProtoFuture(parts={len(self.refs)}{sel})"
