"""``cross_entropy`` with ``[N, K]`` ``target_tokens`` / ``weights`` (Tinker's top-K
distillation, soft targets): ``loss = -sum over t, k of weights[t, k] * logp(target[t, k])``
at position ``t``, and ``logprobs`` out as ``[N, K]``.

A call with any such datum goes to the group as one batch K ids wide (K the call's widest):
``target_ids`` ``[B, S, K]`` and ``target_weights`` ``[B, S, K]`` (``datum.to_tensors``). A
datum with ``[N]`` targets fills column 0 and weighs the others 0. The group computes each
position's log-sum-exp once and gathers the K ids (``trainer/target_logprobs.py``): one forward
pass per datum, whatever K. ``fold`` cuts each datum's log-probs back to its own width.
"""

from __future__ import annotations

import numpy as np

from tgruntime.service.codec import DatumIn
from tgruntime.service.sessions import ServiceError

__all__ = ["SOFT_INPUTS", "fold", "soft_widths"]

SOFT_INPUTS = frozenset({"target_tokens", "weights"})
"""The only inputs a datum with ``[N, K]`` targets may carry."""


def soft_widths(data: list[DatumIn], *, loss: str) -> list[int]:
    """Each datum's K (0 for a datum whose targets are ``[N]``), every ``[N, K]`` one checked."""
    widths: list[int] = []
    for i, d in enumerate(data):
        target = d.inputs.get("target_tokens")
        if target is None or target.ndim != 2:
            widths.append(0)
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
        if weights is not None and weights.shape != (n, k):
            raise ServiceError(
                f"datum {i}: loss_fn_inputs['weights'] has shape {list(weights.shape)}; with "
                f"[{n}, {k}] target_tokens it must be [{n}, {k}] too"
            )
        others = sorted(set(d.inputs) - SOFT_INPUTS)
        if others:
            raise ServiceError(
                f"datum {i}: [N, K] target_tokens take only weights beside them, not {others}"
            )
        widths.append(k)
    return widths


def fold(outputs: list[dict[str, np.ndarray]], widths: list[int]) -> list[dict[str, np.ndarray]]:
    """Per-datum outputs of a K-wide batch (``[N, K]`` log-probs, K the call's widest) cut to
    each datum's own width: ``[N, k]``, or ``[N]`` for a datum of ``[N]`` targets. Outputs of a
    call with no soft datum (``[N]``) pass unchanged."""
    if not any(widths):
        return outputs
    return [
        {name: np.ascontiguousarray(v[:, :k] if k else v[:, 0]) for name, v in out.items()}
        for out, k in zip(outputs, widths, strict=True)
    ]
