"""Scores of one prompt from its prefill: prompt log-probs, top-k, target ids, alternative draws.

Called by both samplers (the one-shot ``Sampler`` and the continuous ``SlotEngine``) with a
function that runs the output layer over prefill positions ``[a, b)`` of one row. Only the
positions some option needs are computed (``LogprobOptions.first_row``): with
``prompt_logprobs_last_n`` and no target or alternative draws, the prefix gets no output layer
at all. Positions go through the output layer ``CHUNK`` at a time, so a long prompt never
holds ``len(prompt) x vocab`` logits at once.

Prefill position ``t`` predicts prompt token ``t + 1``. Every value is the model's own
log-prob (``log_softmax`` of the raw logits); the alternative draws are Gumbel-max draws at the
request's temperature (argmax at 0) with counter-based noise (``noise.py``) keyed by the
request's seed and prompt, so every tensor-parallel rank draws the same tokens and a seeded
request draws the same ones again, on either sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tgruntime.trainer.logprob_options import LogprobOptions
from tgruntime.trainer.sampling.noise import gumbel_noise
from tgruntime.trainer.sampling.params import SamplingParams, row_keys

__all__ = ["CHUNK", "alt_keys", "score_prompt", "topk_rows"]

CHUNK = 256
"""Prefill positions per output-layer call."""

_ALT_SALT = 0x2545F4914F6CDD1D  # alternative draws never reuse a sampled row's noise


def alt_keys(prompt: list[int], *, seed: int | None, k: int) -> list[int]:
    """One noise key per alternative draw (``prompt_alt_tokens_k``) of ``prompt``."""
    return [key ^ _ALT_SALT for key in row_keys([prompt], seed=seed, num_samples=k)]


def topk_rows(logprobs: torch.Tensor, k: int) -> list[list[list[float]]]:
    """``[[id, logprob]] * k`` per row of ``[R, V]`` log-probs, most likely first."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    pairs = torch.stack((ids.double(), values.double()), dim=-1).cpu().tolist()
    return [[[int(i), float(v)] for i, v in row] for row in pairs]


@torch.no_grad()
def score_prompt(
    logits_of: Callable[[int, int], torch.Tensor],
    prompt: list[int],
    params: SamplingParams,
    *,
    seed: int | None,
) -> dict[str, Any]:
    """The prompt's scores asked for by ``params`` (keys absent when not asked):

    ``prompt_logprobs`` ``[len(prompt)]`` (None where not scored: the first token, the prefix
    before ``prompt_logprobs_last_n``), ``topk_prompt_logprobs`` ``[len(prompt)]`` rows of
    ``[id, logprob]`` pairs (None where not scored), ``target_prompt_logprobs``
    ``[len(prompt) - 1, K]`` (0.0 where the request has -1, and in rows before the first that
    names an id), ``prompt_alt_tokens`` ``{"tokens", "logprobs"}`` ``[len(prompt) - 1, k]``.
    ``logits_of(a, b)``: fp32 logits ``[b - a, V]`` of prefill positions ``[a, b)``."""
    opts: LogprobOptions = params.logprobs
    m = len(prompt)
    out: dict[str, Any] = {}
    plp = params.prompt_logprobs
    if plp:
        out["prompt_logprobs"] = [None] * m
    if opts.topk_prompt:
        out["topk_prompt_logprobs"] = [None] * m
    if opts.target is not None:
        out["target_prompt_logprobs"] = [[0.0] * len(opts.target[0]) for _ in range(m - 1)]
    alt_tokens: list[list[int]] = []
    alt_lps: list[list[float]] = []
    first = opts.first_row(m, prompt_logprobs=plp)
    if first is None:
        if opts.alt_k:
            out["prompt_alt_tokens"] = {"tokens": [], "logprobs": []}
        return out
    n = opts.last_n if opts.last_n is not None else m - 1
    scored_from = m - 1 - n  # prompt_logprobs / top-k: positions t >= scored_from
    keys = None
    if opts.alt_k:
        keys = alt_keys(prompt, seed=seed, k=opts.alt_k)
    for a in range(first, m - 1, CHUNK):
        b = min(a + CHUNK, m - 1)
        logits = logits_of(a, b).float()
        dev = logits.device
        lsm = torch.log_softmax(logits, dim=-1)  # [c, V]
        lo = max(a, scored_from)
        if lo < b and (plp or opts.topk_prompt):
            rows = lsm[lo - a :]
            if plp:
                nxt = torch.tensor(prompt[lo + 1 : b + 1], dtype=torch.int64, device=dev)
                vals = rows.gather(-1, nxt.unsqueeze(-1)).squeeze(-1).double().cpu().tolist()
                for t, v in zip(range(lo, b), vals, strict=True):
                    out["prompt_logprobs"][t + 1] = float(v)
            if opts.topk_prompt:
                for t, pairs in zip(range(lo, b), topk_rows(rows, opts.topk_prompt), strict=True):
                    out["topk_prompt_logprobs"][t + 1] = pairs
        if opts.target is not None:
            ids = torch.tensor(opts.target[a:b], dtype=torch.int64, device=dev)  # [c, K]
            got = lsm.gather(-1, ids.clamp(min=0))
            got = torch.where(ids >= 0, got, torch.zeros_like(got))
            for t, row in zip(range(a, b), got.double().cpu().tolist(), strict=True):
                out["target_prompt_logprobs"][t] = [float(v) for v in row]
        if keys is not None:
            tokens, lps = _draws(logits, lsm, keys, a, params.temperature)
            alt_tokens.extend(tokens)
            alt_lps.extend(lps)
    if keys is not None:
        # rows before ``first`` exist only when first > 0, which alt draws never allow
        out["prompt_alt_tokens"] = {"tokens": alt_tokens, "logprobs": alt_lps}
    return out


def _draws(
    logits: torch.Tensor, lsm: torch.Tensor, keys: list[int], a: int, temperature: float
) -> tuple[list[list[int]], list[list[float]]]:
    """k independent draws per position (rows of ``logits`` are positions ``a, a + 1, ...``)."""
    c, vocab = logits.shape
    dev = logits.device
    steps = torch.arange(a, a + c, dtype=torch.int64, device=dev)
    if temperature == 0.0:
        best = logits.argmax(dim=-1, keepdim=True)
        chosen = best.expand(c, len(keys))
    else:
        z = logits / logits.new_full((1,), temperature)
        cols = []
        for key in keys:
            row_keys_t = torch.full((c,), key, dtype=torch.int64, device=dev)
            cols.append((z + gumbel_noise(row_keys_t, steps, vocab)).argmax(dim=-1))
        chosen = torch.stack(cols, dim=-1)  # [c, k]
    lps = lsm.gather(-1, chosen)
    return chosen.cpu().tolist(), lps.double().cpu().tolist()
