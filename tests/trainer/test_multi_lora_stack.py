"""``MultiLora``'s concatenate-and-mask deltas against a float64 per-row reference (one
process, CPU, a 1-rank gloo group for megatron's tensor-parallel regions).

Three adapter sets of ranks 4, 8 and 16 (the rank-8 set adapts no MLP linear) over a stand-in
model of three megatron-like linears: a fused q/k/v (column-parallel), an output projection
(row-parallel) and a fused gate/up (column-parallel). Rows use the slots
[0, 1, 2, 3, 1, 0, 3, 2]; each row's delta must be ``scaling[s] * B_s @ A_s @ x`` of its own
slot (exactly zero for the base's rows and for a set that does not adapt the linear).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tgruntime.trainer.hf_weights import LlamaShape
from tgruntime.trainer.lora.adapters import (
    COLUMN,
    FUSE_GATED,
    FUSE_NONE,
    FUSE_QKV,
    ROW,
    LinearLora,
    Part,
)
from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.multi import MultiLora, StackedLinear
from tgruntime.trainer.lora.settings import LoraSettings
from tgruntime.trainer.sampling.lean_layer import _lora_out

pytestmark = pytest.mark.megatron

HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM = 16, 24, 4, 2, 4
SETS = [  # (rank, alpha, train_mlp): scalings 1.5, 0.5, 1.5
    (4, 6.0, True),
    (8, 4.0, False),
    (16, 24.0, True),
]
SLOTS = [0, 1, 2, 3, 1, 0, 3, 2]
SEQ = 3
REL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A 1-rank gloo group and megatron's groups on it (TP = 1: the regions are identities)."""
    from tgruntime.trainer.distributed import destroy_parallel, init_model_parallel

    created = not dist.is_initialized()
    if created:
        path = Path(tmp_path_factory.mktemp("gloo")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    init_model_parallel(tp=1, pp=1, cp=1)
    try:
        yield
    finally:
        destroy_parallel(destroy_process_group=created)


class _Base(torch.nn.Module):
    """A stand-in for a megatron linear: ``forward(x) -> (x @ W^T, None)``."""

    def __init__(self, in_features: int, out_features: int, gen: torch.Generator) -> None:
        super().__init__()
        weight = torch.randn(out_features, in_features, generator=gen)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)  # frozen, as a base

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.t(), None


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.qkv = _Base(HIDDEN, HEADS * HEAD_DIM + 2 * GROUPS * HEAD_DIM, gen)
        self.proj = _Base(HEADS * HEAD_DIM, HIDDEN, gen)
        self.fc1 = _Base(HIDDEN, 2 * FFN, gen)


def _parts(*names_in_out: tuple[str, int, int]) -> list[Part]:
    return [
        Part(hf_module=f"model.layers.0.{n}", in_features=i, out_features=o)
        for n, i, o in names_in_out
    ]


def _adapters(model: _Model, *, rank: int, alpha: float, mlp: bool, seed: int) -> LoraAdapters:
    """One adapter set with random ``A`` and ``B`` (B non-zero), its hooks off."""
    settings = LoraSettings(rank=rank, alpha=alpha, seed=seed, train_mlp=mlp)
    shape = LlamaShape(
        vocab_size=32,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        max_position_embeddings=64,
    )
    adapters = LoraAdapters(settings=settings, shape=shape)
    adapters.detach()
    q, kv = HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    qkv = _parts(
        ("self_attn.q_proj", HIDDEN, q),
        ("self_attn.k_proj", HIDDEN, kv),
        ("self_attn.v_proj", HIDDEN, kv),
    )
    layout = [
        ("qkv", COLUMN, FUSE_QKV, qkv),
        ("proj", ROW, FUSE_NONE, _parts(("self_attn.o_proj", q, HIDDEN))),
    ]
    if mlp:
        gate_up = _parts(("mlp.gate_proj", HIDDEN, FFN), ("mlp.up_proj", HIDDEN, FFN))
        layout.append(("fc1", COLUMN, FUSE_GATED, gate_up))
    gen = torch.Generator().manual_seed(100 + seed)
    for name, kind, fuse, parts in layout:
        adapter = LinearLora(
            kind=kind,
            fuse=fuse,
            parts=parts,
            rank=rank,
            scaling=settings.scaling,
            seed=seed,
            tp_size=1,
            tp_rank=0,
            device=torch.device("cpu"),
            heads_per_group=HEADS // GROUPS,
            head_dim=HEAD_DIM,
        )
        with torch.no_grad():
            for param in adapter.parameters():
                param.copy_(torch.randn(param.shape, generator=gen))
        adapters.add(name, adapter, model.get_submodule(name))
    return adapters


@pytest.fixture(scope="module")
def model() -> _Model:
    return _Model()


@pytest.fixture(scope="module")
def sets(model: _Model) -> list[LoraAdapters]:
    return [
        _adapters(model, rank=r, alpha=a, mlp=mlp, seed=i + 1) for i, (r, a, mlp) in enumerate(SETS)
    ]


def _input(name: str, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    width = HEADS * HEAD_DIM if name == "proj" else HIDDEN
    return torch.randn(SEQ, rows, width, generator=gen)


def _reference(sets: list[LoraAdapters], name: str, x: torch.Tensor, slots: list[int]) -> Any:
    """Float64, row by row: ``scaling[s] * (x @ A_s^T @ B_s^T)`` per part, fused by the
    adapter's layout; zeros for slot 0 and for a set without this linear."""
    rows = []
    for r, slot in enumerate(slots):
        entry = dict(sets[slot - 1].items()).get(name) if slot else None
        template = next(e for s in sets if (e := dict(s.items()).get(name)) is not None)
        xr = x[:, r].double()
        pieces = []
        for part in template.parts:
            key = part.hf_module.rsplit(".", 1)[-1]
            if entry is None:
                out = template.lora_B[key].shape[0]
                pieces.append(torch.zeros(SEQ, out, dtype=torch.float64))
            else:
                a, b = entry.lora_A[key].detach().double(), entry.lora_B[key].detach().double()
                pieces.append(entry.scaling * (xr @ a.t() @ b.t()))
        rows.append(template._combine(pieces))
    return torch.stack(rows, dim=1)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def test_delta_equals_float64_reference_per_row(model: _Model, sets: list[LoraAdapters]) -> None:
    multi = MultiLora(model, sets)
    multi.set_rows(SLOTS)
    assert multi.rank == 16 and multi.scaling == (0.0, 1.5, 0.5, 1.5)
    assert multi.dtype == torch.float32
    for name, linear in multi.linears.items():
        assert linear.rank == 16 and linear.a.dtype == torch.float32
        x = _input(name, len(SLOTS))
        got = linear.delta(x, multi.mask)
        want = _reference(sets, name, x, SLOTS)
        assert got.shape == want.shape
        assert _rel_err(got, want) < REL, name
        # the lean decode step's form: x A^T, the mask, the fused B (one token a row)
        lean = _lora_out(x[0] @ linear.a.t(), linear.fused, multi.mask)
        assert _rel_err(lean, want[0]) < REL, name
        for r, slot in enumerate(SLOTS):
            if slot == 0 or (name == "fc1" and slot == 2):
                assert torch.equal(got[:, r], torch.zeros_like(got[:, r])), (name, r)
            else:
                assert got[:, r].abs().max() > 0, (name, r)


def test_hooks_add_the_delta_and_narrowed_runs_a_slice(
    model: _Model, sets: list[LoraAdapters]
) -> None:
    multi = MultiLora(model, sets)
    multi.set_rows(SLOTS)
    x = _input("qkv", len(SLOTS))
    base = model.qkv(x)[0]
    multi.attach()
    try:
        full = model.qkv(x)[0]
        assert _rel_err(full - base, _reference(sets, "qkv", x, SLOTS)) < REL
        with multi.narrowed(2, 6):
            assert multi.index.tolist() == SLOTS[2:6] and multi.mask.shape[0] == 4
            part = model.qkv(x[:, 2:6])[0]
            with pytest.raises(RuntimeError, match="the batch has 8 rows, the row map 4"):
                model.qkv(x)
        torch.testing.assert_close(part, full[:, 2:6], rtol=0, atol=1e-6)
        assert multi.index.tolist() == SLOTS  # back to the whole batch
    finally:
        multi.detach()
    assert torch.equal(model.qkv(x)[0], base)


def test_set_rows_rewrites_the_same_buffers(model: _Model, sets: list[LoraAdapters]) -> None:
    multi = MultiLora(model, sets)
    multi.set_rows(SLOTS)
    index, mask = multi.index.data_ptr(), multi.mask.data_ptr()
    other = [3, 3, 0, 2, 1, 1, 0, 3]
    multi.set_rows(other)
    assert (multi.index.data_ptr(), multi.mask.data_ptr()) == (index, mask)
    assert multi.index.tolist() == other
    linear = multi.linears["proj"]
    x = _input("proj", len(other))
    assert _rel_err(linear.delta(x, multi.mask), _reference(sets, "proj", x, other)) < REL
    multi.set_rows([1, 2, 3])  # another row count: its own buffers
    assert multi.mask.data_ptr() != mask and multi.mask.shape == (3, 3 * 16)
    multi.set_rows(SLOTS)  # back: the first ones again
    assert (multi.index.data_ptr(), multi.mask.data_ptr()) == (index, mask)


def test_column_mask_and_copies(model: _Model, sets: list[LoraAdapters]) -> None:
    multi = MultiLora(model, sets)
    multi.set_rows([0, 2, 3])
    mask = multi.mask
    assert torch.equal(mask[0], torch.zeros(48))
    assert torch.equal(
        mask[1], torch.cat([torch.zeros(16), torch.full((16,), 0.5), torch.zeros(16)])
    )
    assert torch.equal(mask[2], torch.cat([torch.zeros(32), torch.full((16,), 1.5)]))
    qkv = multi.linears["qkv"]
    assert qkv.a.shape == (3 * 48, HIDDEN)  # q, k, v: 3 slots x 16 columns each
    assert {k: tuple(b.shape) for k, b in qkv.b.items()} == {
        "q_proj": (16, 48),
        "k_proj": (8, 48),
        "v_proj": (8, 48),
    }
    expected = sum(
        4 * (linear.a.numel() + linear.fused.numel() + sum(b.numel() for b in linear.b.values()))
        for linear in multi.linears.values()
    )
    assert qkv.fused.shape == (16 + 8 + 8, 3 * 48)  # every output over every key's columns
    assert multi.nbytes() == expected > 0


def test_stacked_linear_alone_and_in_bf16(sets: list[LoraAdapters]) -> None:
    """A StackedLinear with its own rank and mask equals each adapter's own forward; in
    bf16 its copies are bf16 and its delta is LinearLora.forward's on a bf16 input."""
    entries = [dict(s.items())["qkv"] for s in sets]
    x = _input("qkv", len(SLOTS))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        linear = StackedLinear("qkv", entries, dtype=dtype)
        assert linear.a.dtype == dtype and all(b.dtype == dtype for b in linear.b.values())
        got = linear.delta(x.to(dtype), linear.mask(SLOTS)).float()
        for r, slot in enumerate(SLOTS):
            if slot == 0:
                assert torch.equal(got[:, r], torch.zeros_like(got[:, r]))
                continue
            with torch.no_grad():
                want = entries[slot - 1](x[:, r : r + 1].to(dtype)).float()[:, 0]
            assert float((got[:, r] - want).abs().max() / want.abs().max()) < tol, (dtype, r)


def test_model_dtype_and_refusals(model: _Model, sets: list[LoraAdapters]) -> None:
    bf16 = _Model().to(torch.bfloat16)
    multi = MultiLora(bf16, sets)
    multi.set_rows(SLOTS)
    assert multi.dtype == torch.bfloat16 and multi.mask.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="slot 4 is outside"):
        multi.set_rows([0, 4])
    entries = [dict(s.items())["proj"] for s in sets]
    with pytest.raises(ValueError, match="rank 8 is below an adapter's rank 16"):
        StackedLinear("proj", entries, rank=8)
    with pytest.raises(ValueError, match="no adapter set adapts"):
        StackedLinear("proj", [None, None])
    odd = _adapters(model, rank=4, alpha=6.0, mlp=True, seed=9)
    dict(odd.items())["proj"].scaling = 3.0  # a set whose linears disagree
    with pytest.raises(ValueError, match="one scaling per set"):
        MultiLora(model, [odd])


def test_refill_writes_new_sets_in_place_and_refuses_what_does_not_fit(
    model: _Model, sets: list[LoraAdapters]
) -> None:
    """``refill`` (an RL loop's new snapshot taking the old one's slot): the same buffers
    (a CUDA graph captured over the hooks stays valid), deltas of the new sets, zeros in the
    slots past them; a set that does not fit changes nothing."""
    multi = MultiLora(model, sets[:2])  # ranks 4 and 8: 8 columns a slot, fc1 in slot 1 only
    addresses = {
        name: (
            linear.a.data_ptr(),
            linear.fused.data_ptr(),
            *(b.data_ptr() for b in linear.b.values()),
        )
        for name, linear in multi.linears.items()
    }
    fresh = [
        _adapters(model, rank=r, alpha=a, mlp=m, seed=20 + i)
        for i, (r, a, m) in enumerate([(8, 4.0, True), (4, 6.0, False)])
    ]
    assert multi.refill(fresh) is None
    assert multi.scaling == (0.0, 0.5, 1.5)
    slots = [0, 2, 1, 2, 1, 0, 1, 2]
    multi.set_rows(slots)
    for name, linear in multi.linears.items():
        pointers = (linear.a.data_ptr(), linear.fused.data_ptr())
        assert (*pointers, *(b.data_ptr() for b in linear.b.values())) == addresses[name]
        x = _input(name, len(slots))
        want = _reference(fresh, name, x, slots)
        assert _rel_err(linear.delta(x, multi.mask), want) < REL
        lean = _lora_out(x[0] @ linear.a.t(), linear.fused, multi.mask)
        assert _rel_err(lean, want[0]) < REL, name  # the fused B was refilled too
    # one set into two slots: slot 2 holds zeros, its rows get no delta
    assert multi.refill(sets[:1]) is None
    multi.set_rows([1, 2, 0])
    x = _input("fc1", 3)
    got = multi.linears["fc1"].delta(x, multi.mask)
    assert _rel_err(got[:, :1], _reference(sets[:1], "fc1", x[:, :1], [1])) < REL
    assert torch.equal(got[:, 1:], torch.zeros_like(got[:, 1:]))
    before = {name: linear.a.clone() for name, linear in multi.linears.items()}
    assert "3 adapters for 2 slots" in str(multi.refill(sets))
    assert "rank 16 over the 8 columns" in str(multi.refill([sets[2]]))
    assert all(torch.equal(linear.a, before[n]) for n, linear in multi.linears.items())
    odd = _adapters(model, rank=4, alpha=6.0, mlp=True, seed=9)
    dict(odd.items())["proj"].scaling = 3.0  # a set whose linears disagree
    assert "one scaling per set" in str(multi.refill([odd]))
    assert multi.scaling == (0.0, 1.5, 0.0)
    assert all(torch.equal(linear.a, before[n]) for n, linear in multi.linears.items())


def test_a_uniform_map_serves_any_row_count(model: _Model, sets: list[LoraAdapters]) -> None:
    """``set_uniform``: one row map for every forward (a prompt's prefill of 1 row, its
    samples' decode of 8), each row with that slot's delta, through the hooks and the lean
    step's form."""
    multi = MultiLora(model, sets)
    multi.set_uniform(3)
    for rows in (1, 3, 8):
        x = _input("qkv", rows)
        want = _reference(sets, "qkv", x, [3] * rows)
        linear = multi.linears["qkv"]
        assert _rel_err(linear.delta(x, multi.mask), want) < REL
        assert _rel_err(_lora_out(x[0] @ linear.a.t(), linear.fused, multi.mask), want[0]) < REL
    multi.attach()
    try:
        x = _input("qkv", 5)
        assert multi.mask.shape[0] == 1
        got = model.qkv(x)[0]
        multi.set_rows([3])  # a per-row map of one row is not a uniform one
        with pytest.raises(RuntimeError, match="the batch has 5 rows, the row map 1"):
            model.qkv(x)
    finally:
        multi.detach()
    assert _rel_err(got - model.qkv(x)[0], _reference(sets, "qkv", x, [3] * 5)) < REL
    with pytest.raises(ValueError, match="slot 4 is outside"):
        multi.set_uniform(4)
