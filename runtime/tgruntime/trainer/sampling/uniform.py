"""The one-slot adapter stacks of one-shot sampling from a snapshot (issue 35).

A one-shot call whose rows all use snapshot ``name`` runs through a one-slot
:class:`~tgruntime.trainer.lora.multi.MultiLora` with a uniform row map, so its decode takes
the lean layers with the stack's deltas. The sampler's CUDA graphs are keyed by the stack
object, so a stack is kept and, when its snapshot changes or a new snapshot needs one, written
in place (``MultiLora.refill``: every buffer keeps its address) rather than built anew. An RL
loop that saves a new snapshot every step and samples from it builds one stack, then refills
it. The active run's own one-shot sampling (``sample(weights=None)``) takes a stack too,
written from the live adapters at every call (a copy of the adapters: well under a
millisecond on a GPU for rank 32), so that its decode takes the lean layers as well.
"""

from __future__ import annotations

import collections

import torch

from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.multi import MultiLora

__all__ = ["ACTIVE_RUN", "LIVE", "UNIFORM_STACKS", "UniformStacks"]

UNIFORM_STACKS = 4
"""Stacks kept: about twice the snapshot's adapter bytes each."""

LIVE = -1
"""The version a live entry is kept at (the store's versions count up from 0)."""

ACTIVE_RUN = "\x00active run"
"""The key of the active run's own stack (``sample(weights=None)``; no snapshot name)."""


class UniformStacks:
    """The last ``keep`` snapshots' one-slot stacks, by name, each with the snapshot store's
    version it was filled at (the store bumps it on every save or drop)."""

    def __init__(self, *, keep: int = UNIFORM_STACKS) -> None:
        if keep < 1:
            raise ValueError(f"UniformStacks: keep must be >= 1, not {keep}")
        self.keep = keep
        self.builds = 0  # stacks allocated
        self.refills = 0  # stacks written in place for another snapshot or a newer version
        self._stacks: collections.OrderedDict[str, tuple[int, MultiLora]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._stacks)

    def get(
        self,
        module: torch.nn.Module,
        name: str,
        version: int,
        adapters: LoraAdapters,
        *,
        live: bool = False,
    ) -> MultiLora:
        """The stack holding ``adapters`` (snapshot ``name`` at store ``version``), its row
        map uniform over slot 1: kept when it is current; else the first kept stack that the
        adapters fit (rank, linears) refilled in place, tried in this order: name's own, those
        filled at an older version (least recently used first), the least recently used one
        when ``keep`` are held; else a new one. ``live``: the adapters change in place between
        calls (the active run's, trained in between): always written again, and kept at
        :data:`LIVE`, which no store version equals (so the entry is never taken as current for
        a snapshot, and is free to take as a spare)."""
        entry = self._stacks.get(name)
        if entry is not None and entry[0] == version and not live:
            self._stacks.move_to_end(name)
            return entry[1]
        # stale: filled at another store version (a live entry always is); a live call must
        # not take a snapshot's current stack while there is room
        for taken in self._candidates(name, version):
            multi = self._stacks[taken][1]
            if multi.refill([adapters]) is None:
                del self._stacks[taken]
                self.refills += 1
                break
        else:  # none kept, or none fits
            self._stacks.pop(name, None)
            while len(self._stacks) >= self.keep:
                self._stacks.popitem(last=False)
            multi = MultiLora(module, [adapters])
            self.builds += 1
        multi.set_uniform(1)
        self._stacks[name] = (LIVE if live else version, multi)
        return multi

    def _candidates(self, name: str, version: int) -> list[str]:
        stale = [n for n, (filled, _) in self._stacks.items() if filled != version]
        order = ([name] if name in self._stacks else []) + [n for n in stale if n != name]
        if len(self._stacks) >= self.keep:
            order.append(next(iter(self._stacks)))
        return list(dict.fromkeys(order))

    def forget(self, name: str) -> None:
        """Drop ``name``'s stack (its snapshot was dropped)."""
        self._stacks.pop(name, None)
