"""Many LoRA adapters in one forward pass: each batch row gets its own adapter's delta.

:class:`MultiLora` takes adapter sets (``LoraAdapters`` of one rank, any ranks, alphas and
switches, trained on this model) and puts one forward hook on every base linear that any of
them adapts. The hook adds, for row ``r`` of the batch, ``scaling[s] * B_s @ A_s @ x_r`` of
the slot ``s = index[r]`` that row uses; slot 0 is no adapter (the base weights).

Per adapted linear and per Hugging Face projection inside it, the slots' ``A``
(``[rank, in]``) and ``B`` (``[out, rank]``) are stacked into ``[slots, r_max, in]`` and
``[slots, out, r_max]``, zero-padded to the largest rank: a padded row of ``A`` gives a zero
in ``A x``, and a padded column of ``B`` multiplies it, so padding adds exactly 0. A slot
whose adapter set does not adapt this linear (its ``train_*`` switch off), and slot 0, hold
zeros: their rows get a zero delta. The forward is then, for ``x`` ``[s, b, in]``:

1. gather each row's ``A`` and ``B`` (``[b, r_max, in]``, ``[b, out, r_max]``);
2. ``h = bmm(x_b, A_rows^T)`` through the same tensor-parallel region as
   :meth:`LinearLora.forward` (``copy_to`` for column-parallel, ``reduce_from``, an
   all-reduce of the partial sums, for row-parallel);
3. ``bmm(h, B_rows^T)``, the parts combined into the fused layout (q/k/v per key/value
   group, gate then up) by the adapters' own ``_combine``, times the row's scaling; in the
   input's dtype, as ``LinearLora.forward``.

This is for sampling (no autograd through the stacked copies). The hooks read the row ->
slot map :attr:`MultiLora.index`; :meth:`MultiLora.narrowed` points it at a slice of the
rows for a forward over those rows only (the sampler's per-prompt prompt log-probs). The
decode step has no host synchronisation here, so it can be captured in a CUDA graph: the
stacks and the row maps keep their addresses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from tgruntime.trainer.lora.adapters import COLUMN, LinearLora
from tgruntime.trainer.lora.inject import LoraAdapters

__all__ = ["MultiLora", "StackedLinear"]


def _part_key(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]


class StackedLinear:
    """The stacked adapters of one megatron linear (slot 0: zeros)."""

    def __init__(self, name: str, entries: Sequence[LinearLora | None]) -> None:
        present = [e for e in entries if e is not None]
        if not present:
            raise ValueError(f"{name}: no adapter set adapts this linear")
        template = present[0]
        self.name = name
        self.template = template
        self.kind = template.kind
        self.keys = [_part_key(p.hf_module) for p in template.parts]
        self.rank = max(e.rank for e in present)
        slots = len(entries) + 1
        device = template.lora_A[self.keys[0]].device
        self.scaling = torch.zeros(slots, dtype=torch.float32, device=device)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        for key in self.keys:
            a0, b0 = template.lora_A[key], template.lora_B[key]
            a = torch.zeros(slots, self.rank, a0.shape[1], dtype=torch.float32, device=device)
            b = torch.zeros(slots, b0.shape[0], self.rank, dtype=torch.float32, device=device)
            for slot, entry in enumerate(entries, start=1):
                if entry is None:
                    continue
                ea, eb = entry.lora_A[key], entry.lora_B[key]
                if ea.shape[1] != a0.shape[1] or eb.shape[0] != b0.shape[0]:
                    raise ValueError(
                        f"{name}.{key}: adapter shapes {tuple(ea.shape)}/{tuple(eb.shape)} do "
                        f"not fit {tuple(a0.shape)}/{tuple(b0.shape)} (another model or layout)"
                    )
                a[slot, : entry.rank].copy_(ea.detach())
                b[slot, :, : entry.rank].copy_(eb.detach())
            self.a[key], self.b[key] = a, b
        for slot, entry in enumerate(entries, start=1):
            if entry is not None:
                self.scaling[slot] = entry.scaling

    def delta(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Row ``r``'s delta from slot ``index[r]``; ``x`` ``[s, b, in]`` -> ``[s, b, out]``
        (this rank's fused output layout). Computed in ``x``'s dtype, as
        :meth:`LinearLora.forward` does: the float32 stacks are cast after the gather."""
        dtype = x.dtype
        xb = x.transpose(0, 1)  # [b, s, in]
        pieces = []
        for key in self.keys:
            a = self.a[key].index_select(0, index).to(dtype)  # [b, r, in]
            h = torch.bmm(xb, a.transpose(1, 2))  # [b, s, r]
            if self.kind == COLUMN:
                h = copy_to_tensor_model_parallel_region(h)
            else:
                h = reduce_from_tensor_model_parallel_region(h)
            b = self.b[key].index_select(0, index).to(dtype)  # [b, out, r]
            pieces.append(torch.bmm(h, b.transpose(1, 2)))  # [b, s, out]
        scale = self.scaling.index_select(0, index).to(dtype).view(-1, 1, 1)
        out = self.template._combine(pieces) * scale
        return out.transpose(0, 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


class MultiLora:
    """Per-row adapters over one model: slot ``i + 1`` is ``sets[i]``, slot 0 the base.

    Built detached; :meth:`attach` puts the hooks on (the model's own adapters, i.e. the
    active run's, must be detached first), :meth:`detach` takes them off.
    """

    def __init__(self, module: torch.nn.Module, sets: Sequence[LoraAdapters]) -> None:
        if not sets:
            raise ValueError("MultiLora needs at least one adapter set")
        names: dict[str, None] = {}
        for adapters in sets:
            for name, _ in adapters.items():
                names.setdefault(name, None)
        by_set = [dict(adapters.items()) for adapters in sets]
        self.linears = {
            name: StackedLinear(name, [found.get(name) for found in by_set]) for name in names
        }
        self.slots = len(sets) + 1
        device = next(iter(self.linears.values())).scaling.device
        self._bases = {name: module.get_submodule(name) for name in self.linears}
        self._device = device
        self._maps: dict[int, torch.Tensor] = {}  # row count -> its row map (fixed address)
        self._full = torch.zeros(1, dtype=torch.int64, device=device)
        self.index = self._full
        self._handles: list[Any] = []

    def set_rows(self, slots: Sequence[int]) -> None:
        """The slot of every batch row (0: base weights; ``i + 1``: ``sets[i]``).

        The map of a given row count keeps its address (written in place), so a CUDA graph
        captured over these hooks reads the current map when it is replayed."""
        bad = [s for s in slots if not 0 <= s < self.slots]
        if bad:
            raise ValueError(f"slot {bad[0]} is outside [0, {self.slots})")
        values = torch.tensor(list(slots), dtype=torch.int64)
        buffer = self._maps.get(len(values))
        if buffer is None:
            buffer = torch.empty(len(values), dtype=torch.int64, device=self._device)
            self._maps[len(values)] = buffer
        buffer.copy_(values)
        self._full = buffer
        self.index = self._full

    @contextlib.contextmanager
    def narrowed(self, start: int, stop: int) -> Iterator[None]:
        """Forwards inside the block run rows ``start:stop`` of the batch only."""
        self.index = self._full[start:stop]
        try:
            yield
        finally:
            self.index = self._full

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

    def _hook(self, linear: StackedLinear) -> Any:
        def hook(
            module: torch.nn.Module,
            args: tuple[Any, ...],
            kwargs: dict[str, Any],
            output: Any,
        ) -> Any:
            x = args[0] if args else kwargs["input_"]
            out, bias = output
            index = self.index
            if x.shape[1] != index.numel():
                raise RuntimeError(
                    f"multi-LoRA on {linear.name}: the batch has {x.shape[1]} rows, the row "
                    f"map {index.numel()} (set_rows / narrowed)"
                )
            delta = linear.delta(x, index)
            if delta.shape != out.shape:
                raise RuntimeError(
                    f"multi-LoRA on {linear.name}: the delta has shape {tuple(delta.shape)}, "
                    f"the output {tuple(out.shape)}"
                )
            return out + delta.to(out.dtype), bias

        return hook
