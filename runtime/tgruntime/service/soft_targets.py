"""``cross_entropy`` with ``[N, K]`` ``target_tokens`` / ``weights`` (Tinker's top-K
distillation, soft targets): ``loss = -sum over t, k of weights[t, k] * logp(target[t, k])``
at position ``t``, and ``logprobs`` out as ``[N, K]``.

The group's loss takes one target per position, so a datum with K targets per position goes
to the group as K rows with the same ``model_input``, row ``k`` carrying column ``k`` of the
targets and weights (``expand``). The summed loss of the K rows is the soft-target loss, and
its gradient the soft-target gradient, exactly; the price is K forward passes of that datum
instead of one. ``fold`` puts the K rows' log-probs back as the datum's ``[N, K]``.
"""

from __future__ import annotations

import numpy as np

from tgruntime.service.codec import DatumIn
from tgruntime.service.sessions import ServiceError

__all__ = ["expand", "fold"]


def expand(data: list[DatumIn], *, loss: str) -> tuple[list[DatumIn], list[int]]:
    """The datums with every ``[N, K]`` one split into K ``[N]`` rows, and each datum's K
    (0 for a datum whose targets are ``[N]``)."""
    widths: list[int] = []
    out: list[DatumIn] = []
    for i, d in enumerate(data):
        target = d.inputs.get("target_tokens")
        if target is None or target.ndim != 2:
            widths.append(0)
            out.append(d)
            continue
        n, k = target.shape
        if loss != "cross_entropy":
            raise ServiceError(
                f"datum {i}: loss_fn_inputs['target_tokens'] has shape [{n}, {k}]; the "
                f"[N, K] form (top-K distillation) is cross_entropy's, not {loss!r}'s: "
                "send [N] targets"
            )
        if n != d.tokens.size or k < 1:
            raise ServiceError(
                f"datum {i}: loss_fn_inputs['target_tokens'] has shape [{n}, {k}], but "
                f"model_input has {d.tokens.size} tokens (expected [{d.tokens.size}, K >= 1])"
            )
        weights = d.inputs.get("weights")
        if weights is None:
            weights = np.ones((n, k), np.float32)
        if weights.shape != (n, k):
            raise ServiceError(
                f"datum {i}: loss_fn_inputs['weights'] has shape {list(weights.shape)}; with "
                f"[{n}, {k}] target_tokens it must be [{n}, {k}] too"
            )
        others = sorted(set(d.inputs) - {"target_tokens", "weights"})
        if others:
            raise ServiceError(
                f"datum {i}: [N, K] target_tokens take only weights beside them, not {others}"
            )
        widths.append(k)
        for col in range(k):
            inputs = {
                "target_tokens": np.ascontiguousarray(target[:, col]),
                "weights": np.ascontiguousarray(weights[:, col], dtype=np.float32),
            }
            out.append(DatumIn(d.tokens, inputs))
    return out, widths


def fold(outputs: list[dict[str, np.ndarray]], widths: list[int]) -> list[dict[str, np.ndarray]]:
    """Per-row outputs of the expanded batch back to one per datum (``[N, K]`` log-probs for a
    datum of K targets per position)."""
    folded: list[dict[str, np.ndarray]] = []
    at = 0
    for k in widths:
        if k == 0:
            folded.append(outputs[at])
            at += 1
            continue
        rows = outputs[at : at + k]
        folded.append({name: np.stack([r[name] for r in rows], axis=-1) for name in rows[0]})
        at += k
    return folded
