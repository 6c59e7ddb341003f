"""The sampler-weights budget (spec.training.samplerWeightsMemory; sampling/weights_budget.py).

The decision (pure), the stores within a budget (real files, real tensors, one process), and
the ranks' agreement (two gloo processes whose shards differ in size: both evict the same
copies, or both refuse)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.lora.settings import LoraSettings
from tgruntime.trainer.sampling.snapshots import AdapterSnapshotStore, SnapshotStore
from tgruntime.trainer.sampling.weights_budget import (
    FIELD,
    SamplerWeightsBudgetError,
    WeightsBudget,
    agree_max,
    evictions_needed,
)

MESH = Mesh(
    rank=0, world_size=1, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, cp_rank=0, cp_size=1,
    dp_rank=0, dp_size=1,
)  # fmt: skip
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("held", "need", "limit", "evictable", "count"),
    [
        (0, 10, 100, [], 0),  # fits
        (90, 10, 100, [40], 0),  # exactly fits
        (90, 20, 100, [40, 40], 1),  # the least recently used one
        (90, 60, 100, [40, 40], 2),
        (90, 60, 100, [20, 20], 3),  # not even with both: len + 1
        (0, 101, 100, [], 1),  # more than the whole budget
    ],
)
def test_evictions_needed(
    held: int, need: int, limit: int, evictable: list[int], count: int
) -> None:
    assert evictions_needed(held=held, need=need, limit=limit, evictable=evictable) == count


def test_budget_from_the_spec_or_from_free_memory() -> None:
    set_ = WeightsBudget.resolve("3Mi", free_bytes=1 << 40, where="GPU memory")
    assert (set_.limit, set_.source) == (3 << 20, f"{FIELD} 3Mi")
    auto = WeightsBudget.resolve(
        "", free_bytes=8 << 30, where="host memory available", ranks_sharing=2
    )
    assert auto.limit == (8 << 30) // 4 // 2
    assert "shared by 2 ranks" in auto.source and FIELD in auto.source
    # a large model: a quarter of the free memory holds no copy; two copies within 80% do
    big = WeightsBudget.resolve("", free_bytes=25 << 30, where="GPU memory", copy_bytes=8 << 30)
    assert big.limit == 16 << 30 and big.source.startswith("2 copies of the weights")
    tight = WeightsBudget.resolve("", free_bytes=25 << 30, where="GPU memory", copy_bytes=16 << 30)
    assert tight.limit == int((25 << 30) * 0.8)  # one copy fits; a second is refused, no OOM
    small = WeightsBudget.resolve("", free_bytes=60 << 30, where="GPU memory", copy_bytes=1 << 30)
    assert small.limit == 15 << 30  # the quarter is more
    for bad in ("0", "-1Gi"):
        with pytest.raises(ValueError, match=r"spec\.training\.samplerWeightsMemory"):
            WeightsBudget.resolve(bad, free_bytes=1, where="GPU memory")


@pytest.mark.parametrize(
    ("text", "ok"),
    [("", True), ("8Gi", True), ("1.5G", True), ("0.5Gi", True), ("2147483648", True),
     ("0", False), ("0Gi", False), ("0.0", False), ("-1Gi", False), ("500m", False)],
)
def test_the_spec_field_takes_a_positive_quantity_of_bytes(text: str, ok: bool) -> None:
    """Refused when the spec is parsed (before anything starts), naming the field."""
    import tgapi
    from tgapi.errors import SpecErrors

    wire = {"workers": {"processesPerNode": [1]}, "training": {"samplerWeightsMemory": text}}
    if ok:
        assert tgapi.parse_spec(wire, local=True).training.sampler_weights_memory == text
    else:
        with pytest.raises(SpecErrors, match=r"training\.samplerWeightsMemory"):
            tgapi.parse_spec(wire, local=True)


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 16)  # 272 float32: 1,088 bytes


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_full_weights_within_the_budget(tmp_path: Path) -> None:
    """Disk-backed copies are a cache inside the budget (least recently used out, read back
    from the directory under their name); copies only in memory are never evicted, and one that
    does not fit is refused naming the field, with nothing changed; the store keeps working."""
    copy = _bytes(_module(0))
    store = SnapshotStore(
        copy_bytes=copy, budget=WeightsBudget(limit=3 * copy, source="test budget")
    )
    modules = [_module(i) for i in range(5)]
    for i, m in enumerate(modules):
        store.save(f"named-{i}", m, MESH, str(tmp_path / f"named-{i}"))
        if i == 2:
            store.resolve("named-0", MESH, CPU)  # used again: kept over named-1 and -2
    info = store.resident()
    assert info["names"] == ["named-0", "named-3", "named-4"], info
    assert info["bytes"] == 3 * copy and info["budget_bytes"] == 3 * copy
    # an evicted name is read again from its directory, as saved
    again = store.resolve("named-1", MESH, CPU)
    for n, p in modules[1].named_parameters():
        assert torch.equal(again[n], p.detach())
    assert "named-0" not in store.names()  # the least recently used went for it
    # copies only in memory pin the budget: the third one is refused, nothing changed
    store.save("ephemeral-a", modules[0], MESH)
    store.save("ephemeral-b", modules[1], MESH)
    assert store.resident()["loaded"] == ["named-1"]
    store.save("ephemeral-b", modules[2], MESH)  # the same name again replaces its copy
    assert store.resident()["bytes"] == 3 * copy
    store.save("ephemeral-c", modules[3], MESH)  # fits once the cache's last copy is gone
    assert store.resident()["loaded"] == [] and len(store.names()) == 3
    with pytest.raises(SamplerWeightsBudgetError) as err:
        store.save("ephemeral-d", modules[4], MESH)
    message = str(err.value)
    assert FIELD in message and "ephemeral-a" in message and "kind='inflight'" in message
    assert store.names() == ["ephemeral-a", "ephemeral-b", "ephemeral-c"]  # nothing changed
    store.drop("ephemeral-a")  # its sampling clients went
    store.save("ephemeral-d", modules[4], MESH)
    assert store.names() == ["ephemeral-b", "ephemeral-c", "ephemeral-d"]
    # a copy larger than the whole budget: refused naming it
    small = SnapshotStore(copy_bytes=copy, budget=WeightsBudget(limit=copy - 1, source="x"))
    with pytest.raises(SamplerWeightsBudgetError, match="more than the whole budget"):
        small.save("w", modules[0], MESH, str(tmp_path / "w"))
    assert small.names() == [] and not (tmp_path / "w").exists()


class _Adapters:
    """What AdapterSnapshotStore.save reads of an adapter set: its settings and state."""

    def __init__(self, rank: int, seed: int) -> None:
        self.settings = LoraSettings(rank=rank)
        torch.manual_seed(seed)
        self._state = {"a": torch.randn(rank, 16), "b": torch.randn(16, rank)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._state


def test_adapter_snapshots_within_the_budget(tmp_path: Path) -> None:
    """A LoRA group's adapter snapshots: the same cache (named ones evicted and read back by
    name), the same refusal for in-memory ones; the store's version moves on an eviction (the
    stacks that hold a snapshot are refilled by it)."""
    one = 2 * 4 * 16 * 4  # rank 4: 512 bytes
    store = AdapterSnapshotStore(budget=WeightsBudget(limit=2 * one, source="test budget"))
    runs = [_Adapters(4, i) for i in range(3)]
    for i, a in enumerate(runs):
        store.save(f"n{i}", a, run="r", base="b", mesh=MESH, path=str(tmp_path / f"n{i}"))  # type: ignore[arg-type]
    assert store.names() == ["n1", "n2"]
    version = store.version
    snap = store.resolve("n0", mesh=MESH, base="b", device=CPU)  # evicted: read back
    assert torch.equal(snap.state["a"], runs[0].state_dict()["a"])
    assert store.names() == ["n0", "n2"] and store.version > version
    store.save("e0", runs[0], run="r", base="b", mesh=MESH)  # type: ignore[arg-type]
    store.save("e1", runs[1], run="r", base="b", mesh=MESH)  # type: ignore[arg-type]
    with pytest.raises(SamplerWeightsBudgetError, match=r"samplerWeightsMemory"):
        store.save("e2", _Adapters(8, 3), run="r", base="b", mesh=MESH)  # type: ignore[arg-type]
    assert store.names() == ["e0", "e1"]


# -- two ranks agree ---------------------------------------------------------------------
def _rank_main(rank: int, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    mesh = Mesh(
        rank=rank, world_size=2, tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, cp_rank=0,
        cp_size=1, dp_rank=0, dp_size=1,
    )  # fmt: skip
    torch.manual_seed(0)
    # rank 1's shard is twice rank 0's; both budgets hold 3 of rank 0's copies
    module = torch.nn.Linear(16, 16 * (1 + rank))
    copy = _bytes(module)
    store = SnapshotStore(
        copy_bytes=copy,
        budget=WeightsBudget(limit=3 * 1088, source="test budget"),
        agree=lambda v: agree_max(v, group=None, device=CPU),
    )
    result: dict[str, Any] = {}
    root = Path(out).parent
    store.save("d0", module, mesh, str(root / "d0"))  # rank 1: 2,176 of 3,264
    store.save("d1", module, mesh, str(root / "d1"))  # rank 1 must evict d0; rank 0 too
    result["names"] = store.names()
    store.save("e0", module, mesh)  # rank 1: e0 + d1 = 4,352 > 3,264: evicts d1 everywhere
    try:
        store.save("e1", module, mesh)  # rank 1 cannot fit; rank 0 could: both refuse
        result["refused"] = False
    except SamplerWeightsBudgetError:
        result["refused"] = True
    result["after"] = store.names()
    torch.distributed.barrier()  # still in step
    torch.save(result, out)
    torch.distributed.destroy_process_group()


def test_ranks_evict_and_refuse_together() -> None:
    mp = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        procs = [
            mp.Process(target=_rank_main, args=(r, init, os.path.join(tmp, f"r{r}.pt")))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout=120)
                assert p.exitcode == 0, f"rank exited {p.exitcode} (None: still running)"
        finally:
            for p in procs:
                if p.is_alive():  # a rank stuck in a collective: the test fails, none lingers
                    p.kill()
                    p.join(timeout=10)
        results = [torch.load(os.path.join(tmp, f"r{r}.pt")) for r in range(2)]
    assert results[0] == results[1], results
    assert results[0] == {"names": ["d1"], "refused": True, "after": ["e0"]}, results[0]
