"""verl compatibility, issue 36: the ``verl.utils.tensordict_utils`` helpers for jagged rows,
lists of dicts, mini-batch iteration and comparison (no Ray).

Each expectation is verl's documented behaviour (the helpers' docstrings in
verl/utils/tensordict_utils.py, verl 0.7/0.8):

- ``nested_tensor_from_tensor_list(tensors, ragged_idx=None)``: a jagged nested tensor of the
  rows; 1-D rows give ``[B, j]``; the ragged dimension defaults to the rows' last one
  (``(4, L_i)`` rows give ``[B, 4, j]``, ragged index 2); ``ragged_idx`` must lie in
  ``[1, rows' dims]``.
- ``concat_nested_tensors``: nested, contiguous, 2+ dims each, else AssertionError; the rows
  of all in order (docstring example: lengths [3, 5] + [2, 4] -> [3, 5, 2, 4]).
- ``concat_tensordict_with_none_bsz``: every TensorDict without a batch dimension, else
  AssertionError; returns the first.
- ``concat_tensordict`` (extended): nested keys joined with ``concat_nested_tensors``; all
  TensorDicts must have the same nested keys.
- ``list_of_dict_to_tensordict``: one row per dict; same-shape tensors stacked, tensors of
  different shapes a jagged nested tensor, other values a NonTensorStack.
- ``maybe_fix_3d_position_ids``: a 3-D nested ``position_ids`` gets ragged index 2 back.
- ``make_iterator(td, mini_batch_size, epochs, seed, dataloader_kwargs)``: mini-batches of
  ``mini_batch_size`` for ``epochs`` passes; the batch must divide (AssertionError);
  DataLoader options (shuffle) apply and a seed repeats the order.
- ``assert_tensordict_eq``: AssertionError on different key sets, value types, tensor values
  (nested ones row by row) or non-tensor values.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

import tgruntime.compat.verl.utils.tensordict_utils as tu


def _jagged(*lengths: int, start: int = 0) -> torch.Tensor:
    rows, n = [], start
    for length in lengths:
        rows.append(torch.arange(n, n + length))
        n += length
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _lengths(nt: torch.Tensor) -> list[int]:
    return nt.offsets().diff().tolist()  # type: ignore[attr-defined, no-any-return]


# ----------------------------------------------------------------------------- nested tensors
def test_nested_tensor_from_1d_rows() -> None:
    rows = [torch.arange(3), torch.arange(5), torch.arange(1)]
    nt = tu.nested_tensor_from_tensor_list(rows)
    assert nt.is_nested and nt.layout == torch.jagged and nt.dim() == 2
    assert _lengths(nt) == [3, 5, 1]
    for got, want in zip(nt.unbind(), rows, strict=True):
        assert torch.equal(got, want)


def test_nested_tensor_from_2d_rows_is_ragged_along_the_last_dim_by_default() -> None:
    rows = [torch.randn(4, 3), torch.randn(4, 6)]  # mRoPE position ids: (4, L_i)
    nt = tu.nested_tensor_from_tensor_list(rows)
    assert nt.dim() == 3 and nt._ragged_idx == 2  # type: ignore[attr-defined]
    assert nt.shape[1] == 4 and _lengths(nt) == [3, 6]
    for got, want in zip(nt.unbind(), rows, strict=True):
        assert torch.equal(got, want)
    # ragged_idx=1: the rows' first dimension varies instead
    rows1 = [torch.randn(2, 5), torch.randn(7, 5)]
    nt1 = tu.nested_tensor_from_tensor_list(rows1, ragged_idx=1)
    assert nt1._ragged_idx == 1 and _lengths(nt1) == [2, 7]  # type: ignore[attr-defined]
    assert torch.equal(nt1.unbind()[1], rows1[1])


def test_nested_tensor_refusals() -> None:
    with pytest.raises(AssertionError, match="at least one"):
        tu.nested_tensor_from_tensor_list([])
    with pytest.raises(AssertionError, match=r"ragged_idx must be in \[1, 2\]"):
        tu.nested_tensor_from_tensor_list([torch.zeros(2, 3)], ragged_idx=3)
    with pytest.raises(AssertionError, match=r"ragged_idx must be in \[1, 2\]"):
        tu.nested_tensor_from_tensor_list([torch.zeros(2, 3)], ragged_idx=0)


def test_concat_nested_tensors_keeps_every_row_in_order() -> None:
    t1, t2 = _jagged(3, 5), _jagged(2, 4, start=100)
    out = tu.concat_nested_tensors([t1, t2])
    assert out.is_nested and _lengths(out) == [3, 5, 2, 4]  # verl's docstring example
    want = [*t1.unbind(), *t2.unbind()]
    for got, w in zip(out.unbind(), want, strict=True):
        assert torch.equal(got, w)
    # 3-D rows ([B, 4, j], ragged index 2) keep their ragged dimension
    a = tu.nested_tensor_from_tensor_list([torch.randn(4, 2), torch.randn(4, 5)])
    b = tu.nested_tensor_from_tensor_list([torch.randn(4, 3)])
    ab = tu.concat_nested_tensors([a, b])
    assert ab._ragged_idx == 2 and _lengths(ab) == [2, 5, 3]  # type: ignore[attr-defined]
    assert torch.equal(ab.unbind()[2], b.unbind()[0])


def test_concat_nested_tensors_refusals() -> None:
    with pytest.raises(AssertionError, match="not a nested tensor"):
        tu.concat_nested_tensors([_jagged(2), torch.zeros(2, 3)])
    with pytest.raises(AssertionError, match="nothing"):
        tu.concat_nested_tensors([])


# ----------------------------------------------------------------------------- concatenation
def test_concat_tensordict_with_none_bsz_keeps_the_first() -> None:
    a = tu.get_tensordict({}, {"step": 1})
    b = tu.get_tensordict({}, {"step": 2})
    assert a.batch_size == torch.Size([])
    assert tu.concat_tensordict_with_none_bsz([a, b]) is a
    batched = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(AssertionError, match=r"batch size \[2\]"):
        tu.concat_tensordict_with_none_bsz([a, batched])
    assert tu.concat_tensordict([a, b]) is a  # concat_tensordict routes there


def test_concat_tensordict_joins_nested_keys() -> None:
    a = TensorDict({"ids": _jagged(2, 3), "score": torch.tensor([1.0, 2.0])}, batch_size=[2])
    b = TensorDict({"ids": _jagged(4, start=50), "score": torch.tensor([3.0])}, batch_size=[1])
    out = tu.concat_tensordict([a, b])
    assert out.batch_size == torch.Size([3])
    assert torch.equal(out["score"], torch.tensor([1.0, 2.0, 3.0]))
    assert out["ids"].is_nested and _lengths(out["ids"]) == [2, 3, 4]
    assert torch.equal(out["ids"].unbind()[2], torch.arange(50, 54))
    c = TensorDict({"ids": torch.zeros(1, 2, dtype=torch.long), "score": torch.zeros(1)}, [1])
    with pytest.raises(AssertionError, match="same set of nested tensors"):
        tu.concat_tensordict([a, c])


# ----------------------------------------------------------------------------- lists of dicts
def test_list_of_dict_to_tensordict() -> None:
    rows = [
        {"obs": torch.tensor([1.0, 2.0]), "ids": torch.arange(3), "tag": "a", "meta": {"k": 1}},
        {"obs": torch.tensor([3.0, 4.0]), "ids": torch.arange(5), "tag": "b", "meta": {"k": 2}},
    ]
    td = tu.list_of_dict_to_tensordict(rows)
    assert td.batch_size == torch.Size([2])
    assert torch.equal(td["obs"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))  # same shape: stacked
    assert td["ids"].is_nested and _lengths(td["ids"]) == [3, 5]  # ragged: jagged nested
    assert tu.get(td, "tag") == ["a", "b"]  # other values: one per row
    assert tu.get(td, "meta") == [{"k": 1}, {"k": 2}]
    mixed = tu.list_of_dict_to_tensordict([{"v": torch.zeros(1)}, {"v": 3}])
    assert tu.get(mixed, "v")[1] == 3  # not all tensors: a NonTensorStack
    with pytest.raises(AssertionError):
        tu.list_of_dict_to_tensordict([])
    with pytest.raises(KeyError):  # every dict needs the first one's keys
        tu.list_of_dict_to_tensordict([{"a": 1, "b": 2}, {"a": 3}])


def test_maybe_fix_3d_position_ids() -> None:
    pos = tu.nested_tensor_from_tensor_list([torch.zeros(4, 3), torch.zeros(4, 5)])
    td = TensorDict({"position_ids": pos}, batch_size=[2])
    td["position_ids"]._ragged_idx = 1  # what a pickle round trip of a consolidated td leaves
    tu.maybe_fix_3d_position_ids(td)
    assert td["position_ids"]._ragged_idx == 2
    flat = TensorDict({"position_ids": _jagged(2, 3)}, batch_size=[2])
    tu.maybe_fix_3d_position_ids(flat)  # 2-D: untouched
    assert flat["position_ids"]._ragged_idx == 1
    tu.maybe_fix_3d_position_ids(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))  # no key


# ----------------------------------------------------------------------------- iteration
def _td(n: int) -> TensorDict:
    return tu.get_tensordict({"x": torch.arange(n), "tag": [f"t{i}" for i in range(n)]})


def test_make_iterator_yields_mini_batches_for_each_epoch() -> None:
    batches = list(tu.make_iterator(_td(6), mini_batch_size=2, epochs=2))
    assert len(batches) == 6 and all(b.batch_size == torch.Size([2]) for b in batches)
    order = [b["x"].tolist() for b in batches]
    assert order == [[0, 1], [2, 3], [4, 5]] * 2  # no shuffle by default
    assert tu.get(batches[1], "tag") == ["t2", "t3"]


def test_make_iterator_shuffles_repeatably_with_a_seed() -> None:
    def order(seed: int) -> list[int]:
        it = tu.make_iterator(
            _td(8), mini_batch_size=4, epochs=1, seed=seed, dataloader_kwargs={"shuffle": True}
        )
        return [int(v) for b in it for v in b["x"]]

    first = order(7)
    assert sorted(first) == list(range(8)) and first == order(7)
    assert any(order(s) != first for s in (1, 2, 3))


def test_make_iterator_refusals() -> None:
    with pytest.raises(AssertionError, match="not a multiple of mini_batch_size 4"):
        tu.make_iterator(_td(6), mini_batch_size=4, epochs=1)
    with pytest.raises(AssertionError, match="dataloader_kwargs"):
        tu.make_iterator(_td(4), mini_batch_size=2, epochs=1, dataloader_kwargs=[1])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- comparison
def test_assert_tensordict_eq_passes_on_equal_contents() -> None:
    a = tu.get_tensordict({"x": torch.arange(3), "tag": ["a", "b", "c"]}, {"step": 4})
    a["ids"] = _jagged(1, 2, 3)
    b = pickle.loads(pickle.dumps(a))
    tu.assert_tensordict_eq(a, b)
    tu.assert_tensordict_eq(a, a.clone())


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda td: td.set("extra", torch.zeros(3)), "keys differ"),
        (lambda td: td.set("x", torch.tensor([0, 1, 9])), "'x': the tensors differ"),
        (lambda td: tu.assign_non_tensor(td, x=[0, 1, 2]), "'x': the types differ"),
        (lambda td: tu.assign_non_tensor(td, tag=["a", "b", "z"]), "'tag': the values differ"),
        (lambda td: tu.assign_non_tensor(td, step=5), "'step': the values differ"),
        (lambda td: td.set("ids", _jagged(1, 2, 3, start=1)), "'ids': nested row 0 differs"),
    ],
)
def test_assert_tensordict_eq_names_what_differs(change: object, match: str) -> None:
    def make() -> TensorDict:
        td = tu.get_tensordict({"x": torch.arange(3), "tag": ["a", "b", "c"]}, {"step": 4})
        td["ids"] = _jagged(1, 2, 3)
        return td

    a, b = make(), make()
    change(b)  # type: ignore[operator]
    with pytest.raises(AssertionError, match=match):
        tu.assert_tensordict_eq(a, b)


def test_the_helpers_are_reachable_as_verl_names() -> None:
    from tgruntime.compat import verl

    for name in (
        "concat_nested_tensors", "concat_tensordict_with_none_bsz", "list_of_dict_to_tensordict",
        "maybe_fix_3d_position_ids", "nested_tensor_from_tensor_list", "make_iterator",
        "assert_tensordict_eq",
    ):
        assert name in tu.__all__ and callable(getattr(verl.tensordict_utils, name)), name
