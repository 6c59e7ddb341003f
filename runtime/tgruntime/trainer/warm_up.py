"""Compile before the first request: a warm-up at ``init_model`` on a GPU.

On a GPU the trainer runs two elementwise chains as ``torch.compile``'d kernels (``model.
compiled_fusions``). TorchDynamo compiles at a function's first call, again at the second
distinct shape (then with dynamic shapes, which later shapes reuse), and separately for
gradient and no-gradient calls. Left to the first requests, that is ~11 s of an RL loop's first
iteration on the seed shape on an H100 (docs/tinker.md: the first iteration took 5.1x a steady
one, 1.38x with the compiler off). So ``init_model`` runs, before the group is Ready:

* ``forward_backward`` (cross-entropy) at two batch shapes, then ``zero_grad``: the gradient
  calls' graphs, forward and backward;
* two short generations of different shapes, temperature 1 with a fixed seed (full-weight, or
  on a LoRA group the active run's adapters through the one-slot stack that one-shot sampling
  uses: the lean decode layers with the stack's deltas), when the group samples (pipeline
  size 1): the no-gradient prefill, decode and draw graphs;
* the continuous engine's KV pool and its CUDA graphs, one per batch bucket up to the pool's
  slots (``graphs``: ``SlotEngine.capture_buckets``; tensor and pipeline size 1; groups that
  serve the Tinker API, ``spec.api.tinker``, whose sampling uses the pool). Left to the
  first iteration of an RL loop, a LoRA group captured ten buckets' graphs through the
  adapters' hooks there: that iteration took 1.29x a steady one on an H100 (docs/tinker.md).

The model's weights, the optimizer's state, the step and the RNGs are untouched (no dropout,
seeded sampling, fixed token ids); only gradients, which ``zero_grad`` discards, and the
sampler's graph cache change. ``TG_WARM_UP=0`` turns it off (the first calls compile instead).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

from tgruntime.trainer.engine import TrainEngine
from tgruntime.trainer.model import compiled_fusions
from tgruntime.trainer.sampling.generate import Sampler
from tgruntime.trainer.sampling.params import SamplingParams
from tgruntime.trainer.token_batch import token_batch

__all__ = ["SHAPES", "wanted", "warm_up"]

log = logging.getLogger("tgruntime.trainer.warm_up")

SHAPES = ((2, 40), (3, 72))
"""(rows, tokens) of the two warm-up batches: two distinct shapes, so that the second call
compiles the dynamic-shape graphs that every later shape reuses. No size is 1: Dynamo
specialises sizes 0 and 1 into graphs of their own."""


def wanted(engine: TrainEngine) -> bool:
    """On a GPU with the compiled fusions on, unless ``TG_WARM_UP=0``."""
    if os.environ.get("TG_WARM_UP", "1") == "0":
        return False
    return compiled_fusions(engine.settings)


def _ids(rows: int, tokens: int, vocab: int) -> torch.Tensor:
    """Fixed token ids (no RNG drawn): 1, 2, 3, ... modulo the vocabulary."""
    return (torch.arange(rows * tokens, dtype=torch.int64).reshape(rows, tokens) % (vocab - 1)) + 1


def warm_up(
    engine: TrainEngine,
    sampler: Sampler | None,
    *,
    graphs: Callable[[], int] | None = None,
    generate: Callable[[list[list[int]], SamplingParams], object] | None = None,
) -> float:
    """Run the warm-up calls (every rank of the group at once: they are collective); the
    seconds taken. ``sampler``: the group's sampler (None: no sampling warm-up); ``graphs``:
    captures the continuous engine's graphs, the number captured (None: none); ``generate``:
    how the one-shot path generates (a LoRA group: through the one-slot stack that
    ``sample(weights=None)`` uses, ``SamplingMixin._warm_generate``; None: ``sampler`` with
    the active run's hooks)."""
    start = time.perf_counter()
    vocab = engine.spec.model.vocab_size
    limit = engine.spec.model.max_sequence_length
    for rows, tokens in SHAPES:
        ids = _ids(rows, min(tokens, limit), vocab)
        batch = token_batch({"input_ids": ids}, device=engine.device, vocab_size=vocab)
        engine.forward_backward(batch, loss="cross_entropy")
    engine.zero_grad()
    if sampler is not None and engine.mesh_info.pp_size == 1:
        # temperature 1: the draw (draw.py, compiled on CUDA) compiles here too; a fixed seed
        # draws nothing from any RNG (the noise is a hash of seed, step and token)
        params = SamplingParams.build(vocab_size=vocab, max_tokens=3, temperature=1.0, seed=0)
        for rows, tokens in SHAPES:
            prompts = _ids(rows, min(tokens, limit - 3) // 2, vocab).tolist()
            if generate is not None:
                generate(prompts, params)
            else:
                sampler.generate(prompts, params, hooks=engine.adapters)
    captured = graphs() if graphs is not None and engine.mesh_info.pp_size == 1 else 0
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    log.info(
        "warm-up: compiled the fused kernels and captured %d sampler graphs in %.1f s "
        "(TG_WARM_UP=0 skips it)",
        captured,
        seconds,
    )
    return seconds
