"""The logprob options of ``asample`` (tinker 0.38's ``SampleRequest``) in, and their fields of
``SampleResponse`` out.

In: ``topk_prompt_logprobs``, ``topk_sample_logprobs``, ``prompt_alt_tokens_k``,
``prompt_logprobs_last_n`` and ``target_prompt_logprobs`` (a ``TensorData`` as JSON: int64,
``[len(prompt) - 1, K]``, dense or sparse CSR whose unlisted cells are -1) become one
``LogprobOptions`` (checked here, so a bad request is a 400 at once) plus the target's layout,
which the answer keeps.

Out (``tinker_public_pb2``): ``TopkLogprobs`` as dense row-major ``[length, k]`` matrices with
``(0, -99999.0)`` in positions not scored (the SDK reads such a row as None);
``target_prompt_logprobs`` a float32 tensor of the request's shape and layout (the same CSR
indices when sparse), 0.0 where the request has -1; ``prompt_alt_tokens`` two dense ``[len(prompt)
- 1, k]`` tensors (int32 ids, float32 log-probs).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from tgruntime.service.codec import sample_message
from tgruntime.service.sessions import ServiceError
from tgruntime.trainer.logprob_options import LogprobOptions

__all__ = [
    "MASK_LOGPROB",
    "LogprobRequest",
    "encode_sample_with_options",
    "parse_logprob_request",
]

MASK_LOGPROB = -99999.0
"""The SDK's filler log-prob of a top-k cell with nothing in it (token id 0)."""


@dataclasses.dataclass(frozen=True)
class LogprobRequest:
    options: LogprobOptions
    csr: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # the target's (crow, col)


def _ints(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ServiceError(f"target_prompt_logprobs.{name} must be a list of integers")
    return value


def _target_rows(raw: Any, prompt_len: int) -> tuple[list[list[int]], Any]:
    """The target ids as dense rows (-1 where a CSR tensor lists nothing), and the CSR
    indices (None for a dense tensor)."""
    if not isinstance(raw, dict):
        raise ServiceError(
            "target_prompt_logprobs must be a TensorData (data, dtype, shape), not "
            f"{type(raw).__name__}"
        )
    if raw.get("dtype") != "int64":
        raise ServiceError(
            f"target_prompt_logprobs must be an int64 tensor of token ids, got dtype "
            f"{raw.get('dtype')!r}"
        )
    shape = raw.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise ServiceError(
            f"target_prompt_logprobs must be 2-D, [len(prompt) - 1, K] = "
            f"[{prompt_len - 1}, K], got shape {shape!r}"
        )
    rows, k = shape
    data = _ints(raw.get("data"), "data")
    crow_raw, col_raw = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if crow_raw is None and col_raw is None:
        if len(data) != rows * k:
            raise ServiceError(
                f"target_prompt_logprobs: shape {shape} needs {rows * k} values, data has "
                f"{len(data)}"
            )
        return [data[i * k : (i + 1) * k] for i in range(rows)], None
    crow, col = _ints(crow_raw, "sparse_crow_indices"), _ints(col_raw, "sparse_col_indices")
    if (
        len(crow) != rows + 1
        or crow[0] != 0
        or crow[-1] != len(col)
        or len(col) != len(data)
        or any(b < a for a, b in itertools.pairwise(crow))
        or any(not 0 <= c < k for c in col)
    ):
        raise ServiceError(
            "target_prompt_logprobs: malformed sparse CSR tensor (sparse_crow_indices needs "
            f"rows + 1 = {rows + 1} non-decreasing offsets from 0 to len(data), "
            f"sparse_col_indices one column in [0, {k}) per value)"
        )
    dense = [[-1] * k for _ in range(rows)]
    for r in range(rows):
        for at in range(crow[r], crow[r + 1]):
            dense[r][col[at]] = data[at]
    return dense, (tuple(crow), tuple(col))


def parse_logprob_request(
    body: dict[str, Any], *, prompt_len: int, vocab_size: int
) -> LogprobRequest:
    """The request's logprob options, every one checked against the prompt (``ServiceError``,
    400, naming the field)."""
    raw: dict[str, Any] = {}
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if body.get(name):
            raw[name] = body[name]
    if body.get("prompt_logprobs_last_n") is not None:
        raw["prompt_logprobs_last_n"] = body["prompt_logprobs_last_n"]
    csr = None
    if body.get("target_prompt_logprobs") is not None:
        rows, csr = _target_rows(body["target_prompt_logprobs"], prompt_len)
        raw["target_prompt_logprobs"] = rows
    try:
        options = LogprobOptions.build(
            raw, vocab_size=vocab_size, prompt_logprobs=bool(body.get("prompt_logprobs"))
        )
        options.check_prompt(prompt_len)
    except ValueError as exc:
        raise ServiceError(str(exc).removeprefix("prompt 0: ")) from None
    return LogprobRequest(options=options, csr=csr)


def _topk(rows: Sequence[Sequence[Sequence[float]] | None], k: int) -> pb.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tid, lp) in enumerate((row or [])[:k]):
            ids[i, j], lps[i, j] = int(tid), float(lp)
    return pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows)
    )


def _tensor(values: np.ndarray, dtype: pb.DType.ValueType, shape: Sequence[int]) -> pb.Tensor:
    return pb.Tensor(dense=values.tobytes(), dtype=dtype, shape=list(shape))


def encode_sample_with_options(
    sequences: list[dict[str, Any]], result: dict[str, Any], request: LogprobRequest
) -> bytes:
    """``SampleResponse`` bytes: the sequences and prompt log-probs, plus what ``request``
    asked for from the group's ``result`` (``trainer/sampling/prompt_scores.py``'s keys)."""
    msg = sample_message(sequences, result.get("prompt_logprobs"))
    opts = request.options
    if opts.topk_sample:
        for seq_msg, seq in zip(msg.sequences, sequences, strict=True):
            seq_msg.topk_sampled_logprobs.CopyFrom(
                _topk(seq.get("topk_logprobs") or [], opts.topk_sample)
            )
    if opts.topk_prompt:
        msg.topk_prompt_logprobs.CopyFrom(_topk(result["topk_prompt_logprobs"], opts.topk_prompt))
    if opts.target is not None:
        values = np.asarray(result["target_prompt_logprobs"], dtype=np.float32)
        shape = [len(opts.target), len(opts.target[0])]
        values = values.reshape(shape)
        if request.csr is None:
            msg.target_prompt_logprobs.CopyFrom(_tensor(values, pb.DTYPE_FLOAT32, shape))
        else:
            crow, col = request.csr
            rows = [r for r in range(shape[0]) for _ in range(crow[r + 1] - crow[r])]
            listed = values[rows, list(col)] if col else np.zeros(0, np.float32)
            t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape)
            t.sparse_csr.values = np.ascontiguousarray(listed, dtype=np.float32).tobytes()
            t.sparse_csr.crow_indices = np.asarray(crow, dtype=np.int64).tobytes()
            t.sparse_csr.col_indices = np.asarray(col, dtype=np.int64).tobytes()
            msg.target_prompt_logprobs.CopyFrom(t)
    if opts.alt_k:
        alt = result["prompt_alt_tokens"]
        shape = [len(alt["tokens"]), opts.alt_k]
        tokens = np.asarray(alt["tokens"], dtype=np.int32).reshape(shape)
        lps = np.asarray(alt["logprobs"], dtype=np.float32).reshape(shape)
        msg.prompt_alt_tokens.tokens.CopyFrom(_tensor(tokens, pb.DTYPE_INT32, shape))
        msg.prompt_alt_tokens.logprobs.CopyFrom(_tensor(lps, pb.DTYPE_FLOAT32, shape))
    return bytes(msg.SerializeToString())
