"""verl compatibility, issue 21: DataProto.padding, from_dict(auto_padding=), TensorDict in
DP / N-D dispatch (split per rank, joined with concat_tensordict, also through a
DataProtoFuture) and ``tensordict_utils`` as a dotted module.

The expected values are verl's documented behaviour: ``padding(n, "first")`` appends n
copies of the first row, any other candidate ("last", the default "") n copies of the last
row, in place; ``from_dict(auto_padding=True)`` sets ``meta_info[auto_padding_key]`` and
``is_padding_enabled()`` reports it (or the global ``DataProtoConfig.auto_padding``); N-D
dispatch chunks a TensorDict argument into dp_size parts (rank i gets its dp rank's part)
and collects TensorDict outputs with ``concat_tensordict``.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tgruntime.compat.verl import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    make_nd_compute_dataproto_dispatch_fn,
)
from tgruntime.controller import dispatch as d
from tgruntime.controller.dataproto import AUTO_PADDING_KEY
from tgruntime.controller.decorator import TRIM_KWARG, _trim


# ---------------------------------------------------------------------------- padding()
def _proto(n: int, meta: dict[str, Any] | None = None) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n) * 10, "m": torch.arange(2 * n).reshape(n, 2)},
        {"tag": np.array([f"t{i}" for i in range(n)], dtype=object)},
        meta_info=meta,
    )


@pytest.mark.parametrize(
    ("candidate", "row"), [("first", 0), ("last", 2), ("", 2)], ids=["first", "last", "default"]
)
def test_padding_repeats_the_first_or_last_row_in_place(candidate: str, row: int) -> None:
    data = _proto(3, {"k": 1})
    assert data.padding(padding_size=2, padding_candidate=candidate) is None  # in place, as verl
    assert len(data) == 5
    assert data.batch is not None
    assert data.batch["x"].tolist() == [0, 10, 20, row * 10, row * 10]
    assert data.batch["m"][3:].tolist() == [[2 * row, 2 * row + 1]] * 2
    assert list(data.non_tensor_batch["tag"]) == ["t0", "t1", "t2", f"t{row}", f"t{row}"]
    assert data.meta_info == {"k": 1}


def test_padding_zero_and_refusals() -> None:
    data = _proto(2)
    data.padding(0)
    assert len(data) == 2
    with pytest.raises(ValueError, match="padding_candidate"):
        data.padding(1, padding_candidate="middle")
    with pytest.raises(ValueError, match="padding_size"):
        data.padding(-1)
    with pytest.raises(ValueError, match="no rows"):
        DataProto.from_dict({"x": torch.zeros(0)}).padding(1)


def test_padding_then_chunk_as_verls_dispatch_does() -> None:
    # verl's DP_COMPUTE_PROTO with auto padding: padding(world_size - len % world_size), chunk
    data = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True)
    data.padding(3)
    assert [p.batch["x"].tolist() for p in data.chunk(4)] == [[0, 1], [2, 3], [4, 4], [4, 4]]


# ---------------------------------------------------------------------------- auto_padding
@pytest.fixture
def no_global_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(DataProtoConfig), "_auto_padding", False)
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)


@pytest.mark.usefixtures("no_global_padding")
def test_from_dict_auto_padding_records_verls_flag() -> None:
    assert DataProtoConfig.auto_padding_key == AUTO_PADDING_KEY
    meta = {"step": 1}
    on = DataProto.from_dict({"x": torch.arange(3)}, meta_info=meta, auto_padding=True)
    assert on.meta_info == {"step": 1, DataProtoConfig.auto_padding_key: True}
    assert on.is_padding_enabled()
    assert meta == {"step": 1}  # the caller's dict is not modified (verl's is)
    off = DataProto.from_dict({"x": torch.arange(3)}, meta_info=meta)
    assert not off.is_padding_enabled() and off.meta_info == {"step": 1}
    single = DataProto.from_single_dict({"x": torch.arange(3)}, auto_padding=True)
    assert single.is_padding_enabled()
    # the flag travels with the batch's meta_info: slices and chunks keep it
    assert on[0:2].is_padding_enabled() and all(p.is_padding_enabled() for p in on.chunk(2))
    with pytest.raises(ValueError, match="num_batch_dims"):
        DataProto.from_dict({"x": torch.arange(3)}, num_batch_dims=0)


@pytest.mark.usefixtures("no_global_padding")
def test_chunk_accepts_an_uneven_split_only_with_padding_enabled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = DataProto.from_dict({"x": torch.arange(5)})
    with pytest.raises(ValueError, match="equal parts"):
        plain.chunk(2)
    padded = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True)
    assert [p.batch["x"].tolist() for p in padded.chunk(2)] == [[0, 1, 2], [3, 4]]
    DataProtoConfig.auto_padding = True  # verl's global switch
    assert plain.is_padding_enabled() and [len(p) for p in plain.chunk(2)] == [3, 2]
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert plain.is_padding_enabled()


# ---------------------------------------------------------------------------- pure dispatch
class FakeGroup:
    def __init__(self, n: int, mapping: list[int], collect: list[bool]) -> None:
        self._n, self.mapping, self.collect = n, mapping, collect

    @property
    def world_size(self) -> int:
        return self._n

    def mesh_dispatch_info(self, mesh_name: str) -> list[int]:
        return self.mapping

    def mesh_collect_info(self, mesh_name: str) -> list[bool]:
        return self.collect


def _td(n: int) -> TensorDict:
    from tgruntime.compat.verl.utils import tensordict_utils as tu

    per_row: dict[str, Any] = {
        "x": torch.arange(n),
        "obs": torch.arange(3 * n).reshape(n, 3),
        "turns": [[i] for i in range(n)],
    }
    return tu.get_tensordict(per_row, non_tensor_dict={"experiment": "run_001"})


def _rows(td: DataProto | TensorDict) -> list[int]:
    assert isinstance(td, TensorDict)
    return [int(v) for v in td["x"].tolist()]


def test_dp_compute_proto_splits_a_tensordict_per_rank() -> None:
    import tgruntime.compat.verl.utils.tensordict_utils as tu

    g = FakeGroup(2, [0, 1], [True, True])
    (parts,), kwargs = d.dispatch_dp_compute_data_proto(g, _td(4))
    assert [_rows(p) for p in parts] == [[0, 1], [2, 3]] and TRIM_KWARG not in kwargs
    assert [tu.get(p, "turns") for p in parts] == [[[0], [1]], [[2], [3]]]
    assert all(tu.get(p, "experiment") == "run_001" for p in parts)
    # as a keyword, uneven: the tail part is padded with leading rows and trimmed back
    _, kwargs = d.dispatch_dp_compute_data_proto(g, batch=_td(3))
    assert [_rows(p) for p in kwargs["batch"]] == [[0, 1], [2, 0]]
    assert kwargs[TRIM_KWARG] == [None, (1, 2)]
    trimmed = [_trim(p, t) for p, t in zip(kwargs["batch"], kwargs[TRIM_KWARG], strict=True)]
    assert _rows(tu.concat_tensordict(trimmed)) == [0, 1, 2]


def test_tensordict_parts_own_their_memory() -> None:
    big = TensorDict({"x": torch.arange(100_000.0)}, batch_size=[100_000])
    (parts,), _ = d.dispatch_dp_compute_data_proto(FakeGroup(4, [0, 1, 2, 3], [True] * 4), big)
    # a view would pickle the whole 400 kB storage for every rank
    assert all(len(pickle.dumps(p)) < 150_000 for p in parts)
    assert torch.equal(torch.cat([p["x"] for p in parts]), big["x"])


def test_tensordict_and_dataproto_arguments_share_the_split() -> None:
    g = FakeGroup(2, [0, 1], [True, True])
    meta_only = TensorDict({}, batch_size=[])
    (tds, protos, metas), _ = d.dispatch_dp_compute_data_proto(
        g, _td(4), DataProto.from_dict({"x": torch.arange(4)}), meta_only
    )
    assert [_rows(t) for t in tds] == [p.batch["x"].tolist() for p in protos]
    assert metas == [meta_only, meta_only]  # no batch dimension: broadcast
    with pytest.raises(ValueError, match="same length"):
        d.dispatch_dp_compute_data_proto(g, _td(4), DataProto.from_dict({"x": torch.arange(3)}))


def test_nd_dispatch_gives_each_rank_its_dp_slice_and_collects_tensordicts() -> None:
    import tgruntime.compat.verl.utils.tensordict_utils as tu

    # 4 ranks, tp=2: dp ranks [0, 0, 1, 1], the first rank of each dp group collected
    g = FakeGroup(4, [0, 0, 1, 1], [True, False, True, False])
    mode = make_nd_compute_dataproto_dispatch_fn(mesh_name="train")
    (per_rank,), _ = mode["dispatch_fn"](g, _td(6))
    assert [_rows(p) for p in per_rank] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    outputs = [tu.get_tensordict({"x": p["x"] * 10, "rank": torch.full((len(p),), r)},
                                 {"seen": "yes"}) for r, p in enumerate(per_rank)]
    joined = mode["collect_fn"](g, outputs)
    assert isinstance(joined, TensorDict)
    assert _rows(joined) == [0, 10, 20, 30, 40, 50]
    assert joined["rank"].tolist() == [0, 0, 0, 2, 2, 2] and tu.get(joined, "seen") == "yes"
    # DP_COMPUTE_PROTO collects them the same way
    both = d.collect_dp_compute_data_proto(FakeGroup(2, [0, 1], [True, True]), outputs[1:3])
    assert _rows(both) == [0, 10, 20, 30, 40, 50]
    with pytest.raises(TypeError, match="TensorDict"):
        d.concat_outputs([outputs[0], DataProto.from_dict({"x": torch.arange(3)})])


def test_future_over_tensordict_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """DataProtoFuture.get joins TensorDict parts (the refs stand in for ObjectRefs here)."""
    monkeypatch.setattr(
        "tgruntime.controller.futures.ray.get", lambda refs, timeout=None: list(refs)
    )
    future = DataProtoFuture([_td(3), _td(2)])
    assert _rows(future.get()) == [0, 1, 2, 0, 1]
    assert [_rows(c.get()) for c in future.chunk(2)] == [[0, 1, 2], [0, 1]]
    mixed = DataProtoFuture([_td(1), DataProto.from_dict({"x": torch.arange(1)})])
    with pytest.raises(TypeError, match="must all be DataProto or all TensorDict"):
        mixed.get()


# ---------------------------------------------------------------------------- module path
def test_tensordict_utils_is_a_dotted_module() -> None:
    import tgruntime.compat.verl.utils.tensordict_utils as tu
    from tgruntime.compat.verl import tensordict_utils as lazy
    from tgruntime.compat.verl.utils import tensordict_utils as from_package

    assert tu is lazy is from_package
    assert tu.__name__ == "tgruntime.compat.verl.utils.tensordict_utils"
    for name in (
        "assign_non_tensor", "assign_non_tensor_data", "assign_non_tensor_stack",
        "chunk_tensordict", "concat_tensordict", "contiguous", "get", "get_keys",
        "get_non_tensor_data", "get_tensordict", "index_select_tensor_dict", "pad_to_divisor",
        "pop", "pop_keys", "union_tensor_dict", "unpad", "unwrap_non_tensor_data",
    ):
        assert callable(getattr(tu, name)), name
        assert name in tu.__all__
    empty = [TensorDict({}, batch_size=[]), TensorDict({}, batch_size=[])]
    assert tu.concat_tensordict(empty) is empty[0]  # verl: no batch dimension -> the first


# The TensorDict methods on a real group (TDActor's until 2026-12-06: mark, mark_async, rows)
# run in tests/runtime/test_verl_compat_more.py::test_tensordict_through_a_real_group, on that
# module's one group (two workers that import torch and tensordict: ~24 CPU s a group).
