"""The SDK's protobuf messages (``tinker.proto.tinker_public_pb2``, tinker==0.38.0) in and out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from tgruntime.service.provenance import Span, decode_spans
from tgruntime.service.sessions import ServiceError

_NP: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


@dataclass
class DatumIn:
    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # name -> array, shape kept
    # provenance (Datum.with_provenance): runs tiling model_input / target_tokens, or None
    input_spans: tuple[Span, ...] | None = None
    target_spans: tuple[Span, ...] | None = None


@dataclass
class FwdBwdIn:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumIn]


def _tensor(name: str, msg: pb.Tensor) -> np.ndarray:
    dtype = _NP.get(int(msg.dtype))
    if dtype is None:
        raise ServiceError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    if msg.HasField("sparse_csr"):  # the SDK sends 2-D torch inputs so ([N, K] soft targets)
        return _csr_dense(name, msg, dtype)
    if len(msg.dense) % dtype.itemsize:
        raise ServiceError(
            f"loss_fn_inputs[{name!r}]: {len(msg.dense)} bytes is not a whole "
            f"number of {dtype} values"
        )
    arr = np.frombuffer(msg.dense, dtype=dtype)
    shape = list(msg.shape) or [arr.size]
    if math.prod(shape) != arr.size:
        raise ServiceError(
            f"loss_fn_inputs[{name!r}]: shape {shape} does not hold {arr.size} values"
        )
    out: np.ndarray = arr.reshape(shape).copy()
    return out


def _csr_dense(name: str, msg: pb.Tensor, dtype: np.dtype[Any]) -> np.ndarray:
    """A sparse CSR tensor densified, 0 in every unlisted cell (the SDK's ``pad_value``)."""
    csr = msg.sparse_csr
    shape = list(msg.shape)
    parts = (csr.values, csr.crow_indices, csr.col_indices)
    sizes = (dtype.itemsize, 8, 8)
    if len(shape) != 2 or any(len(b) % size for b, size in zip(parts, sizes, strict=True)):
        raise ServiceError(
            f"loss_fn_inputs[{name!r}]: a sparse CSR tensor must be 2-D with whole values "
            f"and int64 indices (shape {shape})"
        )
    values = np.frombuffer(csr.values, dtype=dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
    rows, cols = shape
    if (
        crow.size != rows + 1
        or (crow.size and (crow[0] != 0 or crow[-1] != col.size))
        or col.size != values.size
        or bool((np.diff(crow) < 0).any())
        or bool(((col < 0) | (col >= cols)).any())
    ):
        raise ServiceError(
            f"loss_fn_inputs[{name!r}]: malformed sparse CSR tensor (shape {shape}, "
            f"{crow.size} row offsets, {col.size} columns, {values.size} values)"
        )
    out = np.zeros((rows, cols), dtype=dtype)
    row_of = np.repeat(np.arange(rows), np.diff(crow))
    out[row_of, col] = values
    return out


def decode_forward_backward(body: bytes) -> FwdBwdIn:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as exc:
        raise ServiceError(f"malformed protobuf ForwardBackwardRequest: {exc}") from None
    if not msg.model_id:
        raise ServiceError("ForwardBackwardRequest without model_id (malformed request?)")
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data: list[DatumIn] = []
    for i, d in enumerate(msg.data):
        parts: list[np.ndarray] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk") if chunk.DESCRIPTOR.oneofs else None
            if kind not in (None, "encoded_text"):
                raise ServiceError(f"datum {i}: {kind} chunks are not supported (text only)")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise ServiceError(f"datum {i}: encoded_text tokens are not int32 bytes")
            parts.append(np.frombuffer(raw, dtype=np.int32).astype(np.int64))
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        inputs = {name: _tensor(name, t) for name, t in d.loss_fn_inputs.items()}
        datum = DatumIn(tokens, inputs)
        if len(d.model_input_spans) or len(d.loss_fn_input_spans):
            datum.input_spans = decode_spans(d.model_input_spans, datum=i, field="model_input")
            datum.target_spans = decode_spans(
                d.loss_fn_input_spans, datum=i, field="loss_fn_inputs"
            )
        data.append(datum)
    return FwdBwdIn(msg.model_id, int(msg.seq_id), msg.loss_fn, config, msg.forward_only, data)


def _batched(arrays: list[np.ndarray], dtype: Any) -> pb.BatchedTensor:
    np_dtype = _NP[int(dtype)]
    flat = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in flat])
    bt = pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in flat), offsets=offsets.tobytes(), dtype=dtype
    )
    return bt


def encode_forward_backward(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    # one ArrayRecord per run of datums whose outputs have the same trailing shape (a [N, K]
    # soft-target datum's logprobs: [K]); the SDK joins the records in order
    runs: list[tuple[Any, list[dict[str, np.ndarray]]]] = []
    for o in outputs:
        sig = tuple((name, a.shape[1:]) for name, a in o.items())
        if runs and runs[-1][0] == sig:
            runs[-1][1].append(o)
        else:
            runs.append((sig, [o]))
    if not runs:
        msg.loss_fn_outputs.add().num_datums = 0
    for _, group in runs:
        rec = msg.loss_fn_outputs.add()
        rec.num_datums = len(group)
        for name, first in group[0].items():
            bt = _batched([o[name] for o in group], pb.DTYPE_FLOAT32)
            bt.trailing_shape.extend(first.shape[1:])
            rec.fields[name].CopyFrom(bt)
    return bytes(msg.SerializeToString())


def encode_sample(
    sequences: list[dict[str, Any]], prompt_logprobs: list[float | None] | None
) -> bytes:
    return bytes(sample_message(sequences, prompt_logprobs).SerializeToString())


def sample_message(
    sequences: list[dict[str, Any]], prompt_logprobs: list[float | None] | None
) -> pb.SampleResponse:
    """The ``SampleResponse`` of sampled sequences and prompt log-probs (NaN where None);
    ``logprob_codec`` adds the logprob options' fields."""
    msg = pb.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
        seq.stop_reason = (
            pb.STOP_REASON_STOP if s.get("stop_reason") == "stop" else pb.STOP_REASON_LENGTH
        )
    if prompt_logprobs is not None:
        vals = [math.nan if v is None else float(v) for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(vals, dtype=np.float32).tobytes()
    return msg
