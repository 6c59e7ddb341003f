"""Tinker ``Datum``s -> the tensors ``TrainerClient.forward_backward`` takes, and back.

One datum per row: ``input_ids`` = model_input, right-padded to the longest datum
(``attention_mask`` marks the real positions); ``loss_fn_inputs`` map through
``tinker_losses.TINKER_INPUTS`` (target_tokens -> target_ids, weights -> loss_mask,
logprobs -> old_log_probs, advantages). Rows are padded to a multiple of the group's
data-parallel size with weight-0 rows (a sum loss gets nothing from them).

A call with ``[N, K]`` targets (soft targets, ``soft_targets.py``) sends ``target_ids`` and
``target_weights`` ``[B, S, K]`` instead of ``target_ids`` and ``loss_mask`` ``[B, S]``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tgruntime.service.codec import DatumIn
from tgruntime.service.sessions import ServiceError
from tgruntime.service.soft_targets import SOFT_INPUTS, soft_widths
from tgruntime.trainer.loss_catalog import resolve_loss
from tgruntime.trainer.losses import TokenTensors
from tgruntime.trainer.tinker_losses import TINKER_INPUTS

NEEDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
    # the sampler's log-probs come from the server's records (service.stability), not the datum
    "stable_reinforce": ("target_tokens", "advantages"),
}
PER_TOKEN = ("target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask")
# ppo/cispo/gspo bounds per datum: one value ([1] or a scalar) or one per token ([N]); they
# override loss_fn_config's, so every datum of the call carries them or none does
THRESHOLDS = ("clip_low_threshold", "clip_high_threshold")


def to_tensors(
    data: list[DatumIn],
    *,
    loss: str,
    vocab_size: int,
    max_len: int,
    dp: int,
    widths: Sequence[int] | None = None,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The batch and each datum's length; every shape and id checked first. ``widths``: each
    datum's K (``soft_targets.soft_widths``; computed when None)."""
    if not data:
        raise ServiceError("forward_backward with no data")
    if widths is None:
        widths = soft_widths(data, loss=loss)
    needs = NEEDS.get(loss, ("target_tokens",))
    lengths: list[int] = []
    for i, d in enumerate(data):
        n = int(d.tokens.size)
        if n == 0:
            raise ServiceError(f"datum {i}: empty model_input")
        if n > max_len:
            raise ServiceError(
                f"datum {i}: {n} tokens exceed the group's sequence limit "
                f"(model.maxSequenceLength {max_len})"
            )
        for name in needs:
            if name not in d.inputs:
                raise ServiceError(f"datum {i}: loss {loss!r} needs loss_fn_inputs[{name!r}]")
        for name, arr in d.inputs.items():
            if name not in TINKER_INPUTS:
                raise ServiceError(
                    f"datum {i}: unknown loss_fn_inputs key {name!r} (known: "
                    f"{sorted(TINKER_INPUTS)})"
                )
            if widths[i] and name in SOFT_INPUTS:
                continue  # [n, K]: checked by soft_widths
            if name in PER_TOKEN and arr.shape != (n,):
                raise ServiceError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}, but "
                    f"model_input has {n} tokens (expected [{n}])"
                )
            if name in THRESHOLDS and arr.shape not in ((n,), (1,), ()):
                raise ServiceError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}: one "
                    f"value ([1]) or one per token ([{n}])"
                )
        bad = d.tokens[(d.tokens < 0) | (d.tokens >= vocab_size)]
        if bad.size:
            raise ServiceError(
                f"datum {i}: model_input token id {int(bad[0])} is outside the vocabulary "
                f"(vocab_size {vocab_size})"
            )
        tgt = d.inputs["target_tokens"]
        badt = tgt[(tgt < 0) | (tgt >= vocab_size)]
        if badt.size:
            raise ServiceError(
                f"datum {i}: target_tokens id {int(badt[0])} is outside the vocabulary "
                f"(vocab_size {vocab_size})"
            )
        lengths.append(n)
    for name in THRESHOLDS:
        have = [i for i, d in enumerate(data) if name in d.inputs]
        if have and len(have) != len(data):
            lacking = next(i for i, d in enumerate(data) if name not in d.inputs)
            raise ServiceError(
                f"datum {lacking}: loss_fn_inputs[{name!r}] is missing, but datum {have[0]} "
                "has it: send it with every datum of the call, or with none (loss_fn_config "
                "then sets it for all)"
            )
    rows = len(data) + (-len(data)) % dp
    s = max(lengths)
    ids = np.zeros((rows, s), np.int64)
    mask = np.zeros((rows, s), np.int64)
    target = np.zeros((rows, s), np.int64)
    weights = np.zeros((rows, s), np.float32)
    extra: dict[str, np.ndarray] = {}
    k = max(widths)
    if k:  # soft targets: K ids a position; an [N] datum fills column 0
        target = np.zeros((rows, s, k), np.int64)
        weights = np.zeros((rows, s, k), np.float32)
    for i, d in enumerate(data):
        n, w = lengths[i], d.inputs.get("weights")
        ids[i, :n] = d.tokens
        mask[i, :n] = 1
        if k:
            cols = widths[i] or 1
            t = d.inputs["target_tokens"].reshape(n, cols)
            target[i, :n, :cols] = t
            weights[i, :n, :cols] = 1.0 if w is None else w.reshape(n, cols)
            continue
        target[i, :n] = d.inputs["target_tokens"]
        weights[i, :n] = 1.0 if w is None else w
        for name in ("logprobs", "advantages", "sequence_ratio_mask", *THRESHOLDS):
            if name in d.inputs:
                value = d.inputs[name].reshape(-1)  # a threshold's one value: every token
                extra.setdefault(name, np.zeros((rows, s), np.float32))[i, :n] = value
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "target_ids": torch.from_numpy(target),
        "target_weights" if k else "loss_mask": torch.from_numpy(weights),
    }
    for name, arr in extra.items():
        batch[TINKER_INPUTS[name]] = torch.from_numpy(arr)
    return batch, lengths


def forward_loss(
    loss: str, log_probs: torch.Tensor, batch: dict[str, torch.Tensor], config: dict[str, Any]
) -> float:
    """The summed loss ``forward`` reports (``loss:sum``): the registered loss ``loss`` on the
    group's log-probs, in float64, weighted by ``loss_mask`` as ``forward_backward`` weights it.

    ``forward`` runs no loss on the group (it asks for log-probs only), so the server computes
    it here from the same function the trainer would run."""
    lp = log_probs.detach().to(torch.float64).cpu()
    if "target_weights" in batch:  # soft targets: -sum(w * logp) over the K ids
        w_soft = batch["target_weights"].to(torch.float64)
        real = batch["attention_mask"].to(torch.float64).unsqueeze(-1)
        return float(-(torch.where(w_soft * real != 0, lp * w_soft * real, 0.0)).sum())
    spec = resolve_loss(loss)
    skip = ("input_ids", "attention_mask", "target_ids")
    tensors = {k: v.to(torch.float64) for k, v in batch.items() if k not in skip}
    spec.check(sorted(tensors))
    per_token, _ = spec.fn(lp, TokenTensors(tensors, loss=spec.name), config)
    w = tensors["loss_mask"] * batch["attention_mask"].to(torch.float64)
    weighted = torch.where(w != 0, per_token.detach().to(torch.float64) * w, torch.zeros_like(w))
    return float(weighted.sum())


def outputs(log_probs: torch.Tensor, lengths: list[int]) -> list[dict[str, np.ndarray]]:
    lp = log_probs.detach().to(torch.float32).cpu().numpy()
    return [{"logprobs": lp[i, :n].copy()} for i, n in enumerate(lengths)]


def metrics(meta: dict[str, Any]) -> dict[str, float]:
    """Tinker's ``name:reduction`` keys (a bare key crashes the SDK)."""
    out = {"loss:sum": float(meta.get("loss", 0.0))}
    for key, value in meta.items():
        if key.startswith("metrics/"):
            try:
                out[f"{key[len('metrics/') :]}:mean"] = float(value)
            except (TypeError, ValueError):
                continue
    return out
