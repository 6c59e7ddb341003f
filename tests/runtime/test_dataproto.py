"""DataProto without Ray: building, selecting, splitting, padding, serialisation."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.runtime.workers import batch_of
from tgruntime.controller import DataProto, tensor_codec
from tgruntime.controller.dataproto import chunk_lengths


def make(n: int = 6) -> DataProto:
    return DataProto.from_dict(
        tensors={"x": torch.arange(n), "m": torch.arange(2 * n, dtype=torch.float32).reshape(n, 2)},
        non_tensors={"tag": [f"s{i}" for i in range(n)]},
        meta_info={"step": 3},
    )


def test_basics_len_getitem_iter() -> None:
    d = make()
    assert len(d) == 6
    assert d.keys() == ["x", "m"]
    item = d[2]
    assert (
        int(item.batch["x"]) == 2
        and item.non_tensor_batch["tag"] == "s2"
        and item.meta_info["step"] == 3
    )
    sl = d[1:4]
    assert (
        len(sl) == 3
        and sl.batch["x"].tolist() == [1, 2, 3]
        and list(sl.non_tensor_batch["tag"]) == ["s1", "s2", "s3"]
    )
    assert batch_of(sl)["x"].data_ptr() == batch_of(d)["x"][1:].data_ptr()  # a view, not a copy
    assert [int(batch_of(i)["x"]) for i in d] == list(range(6))
    picked = d[[5, 0]]
    assert picked.batch["x"].tolist() == [5, 0] and list(picked.non_tensor_batch["tag"]) == [
        "s5",
        "s0",
    ]
    mask = d[np.array([True, False] * 3)]
    assert mask.batch["x"].tolist() == [0, 2, 4]


def test_inconsistent_non_tensor_length_is_rejected() -> None:
    with pytest.raises(ValueError, match="non_tensor_batch"):
        DataProto.from_dict(tensors={"x": torch.arange(3)}, non_tensors={"t": ["a", "b"]})


def test_select_pop_union_rename() -> None:
    d = make()
    s = d.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=["step"])
    assert s.keys() == ["x"] and s.non_tensor_batch == {} and s.meta_info == {"step": 3}
    popped = d.pop(batch_keys=["m"], non_tensor_batch_keys=["tag"])
    assert popped.keys() == ["m"] and "tag" in popped.non_tensor_batch
    assert d.keys() == ["x"] and "tag" not in d.non_tensor_batch
    d.union(popped)
    assert sorted(map(str, d.keys())) == ["m", "x"] and "tag" in d.non_tensor_batch
    other = DataProto.from_dict(tensors={"x": torch.arange(6) + 1})
    with pytest.raises(ValueError, match="differs"):
        d.union(other)
    d.rename(["m"], ["mm"])
    keys = d.keys()
    assert "mm" in keys
    with pytest.raises(KeyError):
        d.select(non_tensor_batch_keys=["nope"])


def test_chunk_split_concat() -> None:
    d = make(6)
    parts = d.chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert batch_of(DataProto.concat(parts))["x"].tolist() == list(range(6))
    assert list(DataProto.concat(parts).non_tensor_batch["tag"]) == [f"s{i}" for i in range(6)]
    with pytest.raises(ValueError, match="pad_to_divisor"):
        d.chunk(4)
    assert [len(p) for p in d.split(4)] == [4, 2]


def test_padding_round_trip() -> None:
    d = make(5)
    padded, pad = d.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8
    assert batch_of(padded)["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert batch_of(padded.unpad(pad))["x"].tolist() == [0, 1, 2, 3, 4]
    same, zero = d.pad_to_divisor(5)
    assert zero == 0 and same is d


def test_chunk_lengths_put_padding_in_the_tail() -> None:
    assert chunk_lengths(10, 4) == ([3, 3, 3, 1], [0, 0, 0, 2])
    assert chunk_lengths(5, 4) == ([2, 2, 1, 0], [0, 0, 1, 2])
    assert chunk_lengths(8, 4) == ([2, 2, 2, 2], [0, 0, 0, 0])
    assert chunk_lengths(0, 3) == ([0, 0, 0], [0, 0, 0])


def test_repeat_reorder_to_clone() -> None:
    d = make(3)
    assert batch_of(d.repeat(2))["x"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch_of(d.repeat(2, interleave=False))["x"].tolist() == [0, 1, 2, 0, 1, 2]
    d.reorder(torch.tensor([2, 0, 1]))
    assert batch_of(d)["x"].tolist() == [2, 0, 1] and list(d.non_tensor_batch["tag"]) == [
        "s2",
        "s0",
        "s1",
    ]
    assert d.to("cpu") is d
    c = d.clone()
    batch_of(c)["x"][0] = 99
    assert batch_of(d)["x"][0] == 2


def test_nested_keys_and_multi_dim_batch() -> None:
    td = TensorDict({"a": torch.ones(4, 3), "b": {"c": torch.zeros(4, 3, 2)}}, batch_size=[4, 3])
    d = DataProto(batch=td)
    keys = d.keys()
    assert len(d) == 4 and ("b", "c") in keys
    back = pickle.loads(pickle.dumps(d))
    assert back.batch.batch_size == torch.Size([4, 3])
    assert torch.equal(back.batch["b", "c"], td["b", "c"])


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.bool,
        torch.uint8,
        torch.float8_e4m3fn,
    ],
)
def test_serialisation_round_trip_every_dtype(dtype: torch.dtype) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    t = base.to(dtype) if dtype is not torch.bool else base > 10
    d = DataProto.from_dict(
        tensors={"t": t}, non_tensors={"o": np.array([{"k": i} for i in range(6)], dtype=object)}
    )
    back = pickle.loads(pickle.dumps(d, protocol=5))
    assert back.batch["t"].dtype == dtype
    assert torch.equal(back.batch["t"].view(torch.uint8), t.contiguous().view(torch.uint8))
    assert back.non_tensor_batch["o"][3] == {"k": 3}


def test_non_contiguous_and_grad_tensors_serialise() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous, batch dim 4
    w = torch.ones(4, 2, requires_grad=True) * 2
    d = DataProto.from_dict(tensors={"x": x, "w": w})
    back = pickle.loads(pickle.dumps(d, protocol=5))
    assert torch.equal(back.batch["x"], x) and not back.batch["w"].requires_grad


def test_tensor_bytes_travel_out_of_band() -> None:
    """Protocol 5: the tensor payload is a separate buffer (what Ray stores zero-copy)."""
    d = DataProto.from_dict(tensors={"big": torch.ones(256, 1024, dtype=torch.bfloat16)})
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    assert len(head) < 4096
    assert sum(memoryview(b).nbytes for b in buffers) == 256 * 1024 * 2
    back = pickle.loads(head, buffers=buffers)
    assert (
        back.batch["big"].dtype == torch.bfloat16 and float(back.batch["big"].sum()) == 256 * 1024
    )


def test_encode_is_zero_copy_and_decode_shares_memory() -> None:
    t = torch.arange(1000, dtype=torch.int32)
    enc = tensor_codec.encode(t)
    assert enc.array.ctypes.data == t.data_ptr()
    back = tensor_codec.decode(enc, copy=False)
    assert back.data_ptr() == t.data_ptr()
    copied = tensor_codec.decode(enc, copy=True)
    assert copied.data_ptr() != t.data_ptr() and torch.equal(copied, t)


def test_empty_dataproto() -> None:
    d = DataProto()
    assert len(d) == 0 and d.keys() == []
    back = pickle.loads(pickle.dumps(d))
    assert back.batch is None
    empty_rows = make(4).slice(0, 0)
    assert len(pickle.loads(pickle.dumps(empty_rows))) == 0
