"""Many LoRA adapters in one forward pass: each batch row gets its own adapter's delta.

:class:`MultiLora` takes adapter sets (``LoraAdapters`` of one rank, any ranks, alphas and
switches, trained on this model) and puts one forward hook on every base linear that any of
them adapts. The hook adds, for row ``r`` of the batch, ``scaling[s] * B_s @ A_s @ x_r`` of
the slot ``s = index[r]`` that row uses; slot 0 is no adapter (the base weights).

Concatenate and mask: no per-row gathers. Every adapter's columns sit side by side, and a
per-row mask keeps the row's own. ``R`` is one rank for the whole :class:`MultiLora` (the
largest adapter rank), and the adapter slots ``1..n`` own the columns ``(s-1)*R .. s*R - 1``
(slot 0, the base, owns none). Per adapted linear and per Hugging Face projection (key)
inside it, built once:

* ``A_cat`` ``[n*R, in]``: the slots' ``A`` (``[rank, in]``) stacked, each zero-padded to
  ``R`` rows; ``B_cat`` ``[out, n*R]``: their ``B`` (``[out, rank]``) side by side, each
  zero-padded to ``R`` columns. A padded row of ``A`` gives a zero in ``A x`` and a padded
  column of ``B`` multiplies it, so padding adds exactly 0; a slot whose adapter set does
  not adapt this linear (its ``train_*`` switch off) holds zeros there.
* both already in the model's dtype: :meth:`LinearLora.forward` casts its float32
  adapters to the input's dtype at every call; the same cast, done once, gives the same
  values, so a step runs no cast.

:meth:`MultiLora.set_rows` writes, once per batch, the column mask ``M`` ``[b, n*R]``:
``M[r, c] = scaling[s]`` where column ``c`` belongs to slot ``s = index[r]``, else 0 (a row
of slot 0 is all zeros). The shared ``R`` is what lets one mask serve every linear. Then,
for ``x`` ``[s, b, in]``:

1. ``h = x @ A_cat^T`` (``[s, b, n*R]``; all keys' ``A_cat`` in one matrix, as
   :meth:`LinearLora.forward` concatenates its keys' ``A``), through the same
   tensor-parallel region as :meth:`LinearLora.forward` (``copy_to`` for column-parallel,
   ``reduce_from``, an all-reduce of the partial sums, for row-parallel);
2. ``h = h * M`` (broadcast over ``s``): each row keeps its slot's columns, already scaled.
   The scaling is folded into the mask, applied on ``h``, not on the output: it costs no
   extra multiply over ``[s, b, out]``, and is in the model's dtype, as the scale the
   per-row version applied to the output was;
3. ``h @ B_cat^T`` per key, the parts combined into the fused layout (q/k/v per key/value
   group, gate then up) by the adapters' own ``_combine``.

Two small GEMMs over all slots' columns and one elementwise multiply, where gathering each
row's ``A`` and ``B`` (``[b, R, in]``, ``[b, out, R]``) copied ``b`` adapters at every
decode step. The price is the other slots' columns: ``n*R*(in + out)`` multiply-adds per row
and token, where the row's own adapter needs ``R*(in + out)``; both are negligible against
the base weights' ``in*out``.

This is for sampling (no autograd through the copies). The hooks read the mask
:attr:`MultiLora.mask` (and the row -> slot map :attr:`MultiLora.index`);
:meth:`MultiLora.narrowed` points both at a slice of the rows for a forward over those rows
only (the sampler's per-prompt prompt log-probs). The hooks have no host synchronisation,
so the decode step can be captured in a CUDA graph: the copies, the masks and the row maps
keep their addresses (one mask and one map per row count, rewritten in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from tgruntime.trainer.lora.adapters import COLUMN, LinearLora
from tgruntime.trainer.lora.inject import LoraAdapters

__all__ = ["MultiLora", "StackHook", "StackedLinear", "column_mask"]


def _part_key(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


def column_mask(slots: Sequence[int], *, scaling: Sequence[float], rank: int) -> torch.Tensor:
    """The mask ``M`` (float32, on the host) of rows in ``slots`` over the columns of the
    adapter slots ``1..len(scaling)-1``, ``rank`` columns each: ``M[r, c] = scaling[s]``
    where column ``c`` belongs to slot ``s = slots[r]``, else 0 (``scaling[0]``, the base's,
    is unused: slot 0 owns no column)."""
    owner = torch.arange((len(scaling) - 1) * rank) // rank + 1  # the slot of each column
    rows = torch.tensor(list(slots), dtype=torch.int64).view(-1, 1)
    scale = torch.tensor(list(scaling), dtype=torch.float32)[owner]
    return torch.where(rows == owner, scale, torch.zeros(()))


class StackedLinear:
    """All slots' adapters of one megatron linear side by side (see the module docstring).

    ``entries[i]`` is slot ``i + 1``'s adapter of this linear (None: that set does not adapt
    it). ``rank`` is the columns per slot (default: the largest rank here; a
    :class:`MultiLora` passes its own, shared by all its linears); ``dtype`` the one the
    model computes in (the copies are stored in it).
    """

    def __init__(
        self,
        name: str,
        entries: Sequence[LinearLora | None],
        *,
        rank: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        present = [e for e in entries if e is not None]
        if not present:
            raise ValueError(f"{name}: no adapter set adapts this linear")
        template = present[0]
        largest = max(e.rank for e in present)
        if rank is not None and rank < largest:
            raise ValueError(f"{name}: rank {rank} is below an adapter's rank {largest}")
        self.name = name
        self.template = template
        self.kind = template.kind
        self.keys = [_part_key(p.hf_module) for p in template.parts]
        self.rank = largest if rank is None else rank
        self.slots = len(entries) + 1
        self.width = len(entries) * self.rank  # the adapter columns of one key
        self.dtype = dtype
        a0 = template.lora_A[self.keys[0]]
        self.device = a0.device
        # all keys' A in one matrix (their rows k*width..(k+1)*width): one GEMM for q/k/v
        self.a = torch.zeros(
            len(self.keys) * self.width, a0.shape[1], dtype=dtype, device=a0.device
        )
        self.b: dict[str, torch.Tensor] = {
            key: torch.zeros(
                template.lora_B[key].shape[0], self.width, dtype=dtype, device=a0.device
            )
            for key in self.keys
        }
        # every key's B in the fused output layout, side by side over the keys' columns
        # (zeros where a key's columns meet another key's outputs): the lean decode step's
        # one GEMM for the whole delta (``sampling.lean_layer._lora_out``)
        outputs = sum(t.shape[0] for t in self.b.values())
        self.fused = torch.zeros(
            outputs, len(self.keys) * self.width, dtype=dtype, device=a0.device
        )
        self.scaling: tuple[float, ...] = ()
        self.adapts: tuple[bool, ...] = ()
        self.fill(entries)

    def fits(self, entries: Sequence[LinearLora | None]) -> str | None:
        """Why ``entries`` cannot be written into these buffers (None: they can): more
        adapters than slots, a rank above the columns per slot, other keys or shapes."""
        if len(entries) > self.slots - 1:
            return f"{len(entries)} adapters for {self.slots - 1} slots"
        for entry in entries:
            if entry is None:
                continue
            if entry.rank > self.rank:
                return f"rank {entry.rank} over the {self.rank} columns of a slot"
            keys = [_part_key(p.hf_module) for p in entry.parts]
            if keys != self.keys or entry.kind != self.kind:
                return f"keys {keys} ({entry.kind}), the stack's {self.keys} ({self.kind})"
            for key in self.keys:
                ea, eb = entry.lora_A[key], entry.lora_B[key]
                if ea.shape[1] != self.a.shape[1] or eb.shape[0] != self.b[key].shape[0]:
                    return (
                        f"{key}: adapter shapes {tuple(ea.shape)}/{tuple(eb.shape)} do not fit "
                        f"in {self.a.shape[1]}/{self.b[key].shape[0]} (another model or layout)"
                    )
        return None

    def fill(self, entries: Sequence[LinearLora | None]) -> None:
        """Write ``entries`` (slot ``i + 1`` = ``entries[i]``; slots past them hold zeros)
        into the buffers in place: their addresses, which CUDA graphs captured over the
        hooks read, never change."""
        reason = self.fits(entries)
        if reason is not None:
            raise ValueError(f"{self.name}: {reason}")
        present = [e for e in entries if e is not None]
        if present:
            self.template = present[0]  # the fused layout's combiner (the same for all)
        padded = [*entries, *([None] * (self.slots - 1 - len(entries)))]
        self.scaling, self.adapts = _padded_flags(entries, self.slots)
        self.a.zero_()
        for k, key in enumerate(self.keys):
            b_cat = self.b[key]
            b_cat.zero_()
            for slot, entry in enumerate(padded, start=1):
                if entry is None:
                    continue
                row = k * self.width + (slot - 1) * self.rank
                self.a[row : row + entry.rank].copy_(entry.lora_A[key].detach())
                col = (slot - 1) * self.rank
                b_cat[:, col : col + entry.rank].copy_(entry.lora_B[key].detach())
        self._fuse()

    def _fuse(self) -> None:
        """:attr:`fused` from :attr:`b`, in place: the combiner of the fused layout is linear
        in its parts, so applying it to each key's ``B^T`` placed at that key's rows of an
        otherwise zero matrix gives the fused ``B^T``."""
        rows = len(self.keys) * self.width
        pieces = []
        for k, key in enumerate(self.keys):
            b_key = self.b[key]
            piece = torch.zeros(rows, b_key.shape[0], dtype=self.dtype, device=self.device)
            piece[k * self.width : (k + 1) * self.width] = b_key.t()
            pieces.append(piece)
        self.fused.copy_(self.template._combine(pieces).t())

    def mask(self, slots: Sequence[int]) -> torch.Tensor:
        """The column mask of rows in ``slots`` with this linear's scalings, on its device
        (a :class:`MultiLora` writes one mask for all its linears instead)."""
        values = column_mask(slots, scaling=self.scaling, rank=self.rank)
        return values.to(device=self.device, dtype=self.dtype)

    def delta(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each row's delta from its own slot; ``x`` ``[s, b, in]``, ``mask`` ``[b, width]``
        (:meth:`mask`) -> ``[s, b, out]`` (this rank's fused output layout).

        In the model's dtype; an input in another dtype gets the copies cast to its own at
        this call, as :meth:`LinearLora.forward` would (slower, but the same function)."""
        a, m, b = self.a, mask, self.b
        if x.dtype != self.dtype:
            a, m = a.to(x.dtype), m.to(x.dtype)
            b = {key: t.to(x.dtype) for key, t in b.items()}
        h = torch.matmul(x, a.t())  # [s, b, keys * width]
        if self.kind == COLUMN:
            h = copy_to_tensor_model_parallel_region(h)
        else:
            h = reduce_from_tensor_model_parallel_region(h)
        h = h.unflatten(-1, (len(self.keys), self.width)) * m.unsqueeze(-2)
        pieces = [torch.matmul(h[..., k, :], b[key].t()) for k, key in enumerate(self.keys)]
        return self.template._combine(pieces)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.fused, *self.b.values()))


def _model_dtype(module: torch.nn.Module, bases: Iterable[torch.nn.Module]) -> torch.dtype:
    """The dtype the adapted linears compute in: their weights' (megatron's bf16 model holds
    bf16 weights and activations); else the model's first floating parameter's."""
    for base in bases:
        weight = getattr(base, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            return weight.dtype
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


Flags = tuple[tuple[float, ...], tuple[bool, ...]]
"""A linear's per-slot scalings and adapts switches (slot 0 the base)."""


def _slot_scaling(flags: Iterable[tuple[str, Flags]], slots: int) -> tuple[float, ...]:
    """One scaling per slot, shared by every linear its set adapts (one mask for all);
    0 for the base and for a set that adapts nothing. ``flags``: each linear's name and
    :data:`Flags`."""
    found: list[float | None] = [None] * slots
    for name, (scaling, adapts) in flags:
        for slot in range(1, slots):
            if not adapts[slot]:
                continue
            value = scaling[slot]
            if found[slot] is None:
                found[slot] = value
            elif found[slot] != value:
                raise ValueError(
                    f"slot {slot}: {name} has scaling {value:g}, another linear of the "
                    f"same adapter set {found[slot]:g} (one scaling per set is assumed)"
                )
    return tuple(0.0 if s is None else s for s in found)


def _padded_flags(entries: Sequence[LinearLora | None], slots: int) -> Flags:
    """A linear's per-slot scalings and switches for ``entries`` over ``slots`` (slot 0 the
    base; the slots past the entries hold nothing)."""
    padded = [*entries, *([None] * (slots - 1 - len(entries)))]
    return (
        (0.0, *(0.0 if e is None else float(e.scaling) for e in padded)),
        (False, *(e is not None for e in padded)),
    )


class MultiLora:
    """Per-row adapters over one model: slot ``i + 1`` is ``sets[i]``, slot 0 the base.

    Built detached; :meth:`attach` puts the hooks on (the model's own adapters, i.e. the
    active run's, must be detached first), :meth:`detach` takes them off. ``dtype``: the
    one the model computes in (default: its adapted linears' weights').
    """

    def __init__(
        self,
        module: torch.nn.Module,
        sets: Sequence[LoraAdapters],
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not sets:
            raise ValueError("MultiLora needs at least one adapter set")
        by_set = [dict(adapters.items()) for adapters in sets]
        names: dict[str, None] = {}
        for found in by_set:
            for name in found:
                names.setdefault(name, None)
        if not names:
            raise ValueError("MultiLora: none of the adapter sets adapts a linear")
        self.rank = max(e.rank for found in by_set for e in found.values())
        self.slots = len(sets) + 1
        self._bases = {name: module.get_submodule(name) for name in names}
        self.dtype = dtype if dtype is not None else _model_dtype(module, self._bases.values())
        self.linears = {
            name: StackedLinear(
                name, [found.get(name) for found in by_set], rank=self.rank, dtype=self.dtype
            )
            for name in names
        }
        self.scaling = _slot_scaling(
            ((n, (li.scaling, li.adapts)) for n, li in self.linears.items()), self.slots
        )
        self.width = (self.slots - 1) * self.rank
        self._device = next(iter(self.linears.values())).device
        # row count -> its row map and column mask (each at a fixed address)
        self._maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._full = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._full_mask = torch.zeros(1, self.width, dtype=self.dtype, device=self._device)
        self.index = self._full
        self.mask = self._full_mask
        self.uniform = False  # set_uniform: the one-row map serves a batch of any size
        self._handles: list[Any] = []

    def refill(self, sets: Sequence[LoraAdapters]) -> str | None:
        """Put ``sets`` in the slots in place (slot ``i + 1`` = ``sets[i]``, the slots past
        them zeros, the base's slot 0 unchanged), keeping every buffer's address, so the
        CUDA graphs captured over these hooks stay valid. None when done; else why the sets
        do not fit this stack (more sets than slots, a larger rank, a linear the stack does
        not adapt, other shapes), and nothing was changed. The row maps keep their slot
        numbers: call :meth:`set_rows` after (the masks carry the new scalings)."""
        if not sets:
            return "no adapter set"
        by_set = [dict(adapters.items()) for adapters in sets]
        extra = sorted({name for found in by_set for name in found} - set(self.linears))
        if extra:
            return f"linears {extra[:3]} the stack does not adapt"
        plans = {name: [found.get(name) for found in by_set] for name in self.linears}
        for name, entries in plans.items():
            reason = self.linears[name].fits(entries)
            if reason is not None:
                return f"{name}: {reason}"
        try:
            scaling = _slot_scaling(
                ((n, _padded_flags(entries, self.slots)) for n, entries in plans.items()),
                self.slots,
            )
        except ValueError as err:
            return str(err)
        for name, entries in plans.items():
            self.linears[name].fill(entries)
        self.scaling = scaling
        return None

    def set_rows(self, slots: Sequence[int]) -> None:
        """The slot of every batch row (0: base weights; ``i + 1``: ``sets[i]``).

        Writes the row map and the column mask of this row count in place (they keep their
        addresses), so a CUDA graph captured over these hooks reads the current ones when it
        is replayed."""
        bad = [s for s in slots if not 0 <= s < self.slots]
        if bad:
            raise ValueError(f"slot {bad[0]} is outside [0, {self.slots})")
        values = torch.tensor(list(slots), dtype=torch.int64)
        mask = column_mask(list(slots), scaling=self.scaling, rank=self.rank)
        buffers = self._maps.get(len(values))
        if buffers is None:
            buffers = (
                torch.empty(len(values), dtype=torch.int64, device=self._device),
                torch.empty(len(values), self.width, dtype=self.dtype, device=self._device),
            )
            self._maps[len(values)] = buffers
        buffers[0].copy_(values)
        buffers[1].copy_(mask)
        self.uniform = False
        self._full, self._full_mask = buffers
        self.index, self.mask = buffers

    def set_uniform(self, slot: int) -> None:
        """Every row of every forward uses ``slot``: a one-row map and mask that broadcast
        over any batch (a one-shot call with one adapter for all its rows, whose prefill
        runs one row a prompt and whose decode runs every sample). Not for :meth:`narrowed`;
        :meth:`set_rows` ends it."""
        self.set_rows([slot])
        self.uniform = True

    @contextlib.contextmanager
    def narrowed(self, start: int, stop: int) -> Iterator[None]:
        """Forwards inside the block run rows ``start:stop`` of the batch only."""
        self.index = self._full[start:stop]
        self.mask = self._full_mask[start:stop]
        try:
            yield
        finally:
            self.index = self._full
            self.mask = self._full_mask

    def nbytes(self) -> int:
        """Bytes of the stacked copies (what a multi-adapter batch adds)."""
        return sum(linear.nbytes() for linear in self.linears.values())

    def attach(self) -> None:
        if self._handles:
            return
        for name, linear in self.linears.items():
            self._handles.append(
                self._bases[name].register_forward_hook(self._hook(linear), with_kwargs=True)
            )

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, linear: StackedLinear) -> StackHook:
        return StackHook(self, linear)


class StackHook:
    """The forward hook :class:`MultiLora` puts on one base linear: adds each row's delta.
    A class, not a closure, so that the sampler's lean decode step can tell these hooks
    from any other and compute the same delta itself (``sampling/lean_layer.py``)."""

    def __init__(self, owner: MultiLora, linear: StackedLinear) -> None:
        self.owner = owner
        self.linear = linear

    def __call__(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> Any:
        linear = self.linear
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        mask = self.owner.mask
        if x.shape[1] != mask.shape[0] and not self.owner.uniform:
            raise RuntimeError(
                f"multi-LoRA on {linear.name}: the batch has {x.shape[1]} rows, the row "
                f"map {mask.shape[0]} (set_rows / narrowed)"
            )
        delta = linear.delta(x, mask)
        if delta.shape != out.shape:
            raise RuntimeError(
                f"multi-LoRA on {linear.name}: the delta has shape {tuple(delta.shape)}, "
                f"the output {tuple(out.shape)}"
            )
        return out + delta.to(out.dtype), bias
