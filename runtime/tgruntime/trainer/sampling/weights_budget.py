"""The memory a rank may keep for sampler weights: ``spec.training.samplerWeightsMemory``.

Sampler weights are the copies that ``save_sampler_weights`` keeps (full weights, or a LoRA
run's adapters) and those read back from a directory. Copies that are also on disk (saved with
a path, or read from one) form a cache inside the budget: the least recently used go first when
a new copy needs room, and an evicted one is read again from its directory at its next use.
Copies that are only in memory (``save_weights_and_get_sampling_client``'s ephemeral ones)
cannot be evicted: the service drops them when no sampling client can use them any more. A copy
that does not fit once every evictable one is gone is refused with
:class:`SamplerWeightsBudgetError`, naming the field, before anything is allocated or written.

The budget is per rank. Empty in the spec: a quarter of the memory free when the rank's first
copy is made (the GPU's, or on the CPU the host's available memory shared by the group's ranks),
or room for two full-weight copies if that is more and fits 80% of the free memory: by the
arithmetic (16 bytes a parameter), a Llama-3-8B trained in full on one 141 GB GPU leaves ~25 GB
free, whose quarter holds no 16 GB copy.

Every rank takes the same decision: :func:`evictions_needed` counts on each rank how many of
its least recently used evictable copies must go (the same names, in the same order, on every
rank: the calls arrive in the same order), and the ranks agree on the largest count
(:func:`agree_max`, one small all-reduce), so a rank whose shard is larger never refuses a save
that another rank goes on writing (its barriers would wait for ever).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tgapi.errors import PicklableError
from tgapi.sizing import human_bytes, parse_quantity

__all__ = [
    "CAP",
    "FIELD",
    "MIN_COPIES",
    "SHARE",
    "SamplerWeightsBudgetError",
    "WeightsBudget",
    "agree_max",
    "evictions_needed",
    "free_memory",
]

FIELD = "spec.training.samplerWeightsMemory"
SHARE = 0.25  # of the memory free when the budget is chosen (no value in the spec)
MIN_COPIES = 2  # ... or room for this many full-weight copies, where
CAP = 0.8  # this share of the free memory holds them


class SamplerWeightsBudgetError(PicklableError, ValueError):
    """A sampler-weights copy does not fit the budget once every evictable copy is gone."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightsBudget:
    limit: int  # bytes this rank may keep
    source: str  # where the number comes from, for messages

    @classmethod
    def resolve(
        cls,
        text: str,
        *,
        free_bytes: int,
        where: str,
        ranks_sharing: int = 1,
        copy_bytes: int = 0,
    ) -> WeightsBudget:
        """``text``: the spec's quantity. Empty: ``SHARE`` of ``free_bytes`` split over
        ``ranks_sharing`` ranks, raised to ``MIN_COPIES`` copies of ``copy_bytes`` (a
        full-weight copy; 0 on a LoRA group) where ``CAP`` of the free memory holds them, so
        that a large model whose quarter of the free memory holds no copy still samples
        snapshots (``where`` says whose memory, for the message)."""
        if text:
            value = parse_quantity(text)
            if value is None or value <= 0:
                raise ValueError(
                    f"{FIELD}: {text!r} is not a positive Kubernetes quantity (e.g. 8Gi); leave "
                    "it empty to take a quarter of the free memory"
                )
            return cls(limit=int(value), source=f"{FIELD} {text}")
        share = max(1, ranks_sharing)
        quarter = int(free_bytes * SHARE) // share
        copies = min(MIN_COPIES * copy_bytes, int(free_bytes * CAP) // share)
        shared = f", shared by {ranks_sharing} ranks" if ranks_sharing > 1 else ""
        if copies > quarter:
            return cls(
                limit=copies,
                source=f"{MIN_COPIES} copies of the weights within {CAP:.0%} of the "
                f"{human_bytes(free_bytes)} of {where} free{shared} (more than a quarter of "
                f"it); {FIELD} sets it",
            )
        return cls(
            limit=quarter,
            source=f"a quarter of the {human_bytes(free_bytes)} of {where} free{shared}; "
            f"{FIELD} sets it",
        )

    def refusal(self, *, what: str, need: int, pinned: Sequence[tuple[str, int]]) -> str:
        held = sum(n for _, n in pinned)
        names = ", ".join(name for name, _ in pinned[:4]) + (" ..." if len(pinned) > 4 else "")
        if need > self.limit:
            why = f"more than the whole budget of {human_bytes(self.limit)} ({self.source})"
        else:
            why = (
                f"and {human_bytes(held)} of the budget of {human_bytes(self.limit)} "
                f"({self.source}) is held by {len(pinned)} copies that are only in memory "
                f"({names}), which go when no sampling client can use them any more"
            )
        return (
            f"sampler weights: keeping {what} needs {human_bytes(need)} on this rank, {why}: "
            f"raise {FIELD}, keep fewer sampling clients of older weights alive, or use "
            "save_weights_and_get_sampling_client(kind='inflight'), which keeps no copy"
        )


def evictions_needed(*, held: int, need: int, limit: int, evictable: Sequence[int]) -> int:
    """How many of ``evictable`` (the evictable copies' bytes, least recently used first) must
    go for ``need`` more bytes to fit beside ``held`` (every copy's bytes) within ``limit``;
    ``len(evictable) + 1`` when even all of them are not enough."""
    over = held + need - limit
    count = 0
    for size in evictable:
        if over <= 0:
            return count
        over -= size
        count += 1
    return count if over <= 0 else len(evictable) + 1


def agree_max(value: int, *, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The largest ``value`` over the ranks (collective: every rank calls it, in the same
    order); ``value`` itself without torch.distributed. ``group``: a gloo group (a CPU
    tensor), else None for the default group (a tensor on ``device``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    where = torch.device("cpu") if group is not None else device
    t = torch.tensor([value], dtype=torch.int64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def free_memory(device: torch.device) -> tuple[int, str, int]:
    """(free bytes, whose memory, the ranks sharing it) for :meth:`WeightsBudget.resolve`."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), "GPU memory", 1
    free = _available_host_memory()
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return int(free), "host memory available", ranks


def _available_host_memory() -> int:
    """/proc/meminfo's MemAvailable (free pages and reclaimable cache), else the free pages,
    else 4 GiB where the platform says neither."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 << 30
