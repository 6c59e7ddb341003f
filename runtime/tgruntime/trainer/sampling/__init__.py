"""Sampling from the group's own Megatron model (docs/sampling.md).

``CachedDecoder`` (KV-cache forward over the trainer's ``GPTModel`` shard), ``Sampler``
(batched generation: temperature, top-k, top-p, seeds, stop sequences, log-probs),
``SnapshotStore`` (named weight copies for sampling while training goes on) and
``SamplingMixin`` (the worker's ``save_sampler_weights`` / ``sample`` group methods).
"""

from __future__ import annotations

from tgruntime.trainer.sampling.decoder import CachedDecoder, KVCache
from tgruntime.trainer.sampling.generate import Sampler
from tgruntime.trainer.sampling.params import SamplingParams

__all__ = ["CachedDecoder", "KVCache", "Sampler", "SamplingParams"]
