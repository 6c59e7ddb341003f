"""``SamplingParams``: one ``sample`` call's settings, checked once on every rank.

Every refusal is a ``ValueError`` whose message names the field, raised before any
collective, so all tensor-parallel ranks fail together and the client sees the reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from tgruntime.trainer.logprob_options import LogprobOptions

__all__ = ["SamplingParams", "check_prompts", "row_keys"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[tuple[int, ...], ...] = ()
    num_samples: int = 1
    prompt_logprobs: bool = False
    logprobs: LogprobOptions = LogprobOptions()  # top-k, targets, alternatives, last_n

    @classmethod
    def build(
        cls,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[Sequence[int]] | None = None,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        logprob_options: Mapping[str, Any] | None = None,
        vocab_size: int,
    ) -> SamplingParams:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, not {max_tokens!r}")
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), not {temperature!r}")
        if not isinstance(top_k, int) or top_k == 0 or top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, not {top_k!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], not {top_p!r}")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, not {num_samples!r}")
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed must be an integer or None, not {seed!r}")
        stops: list[tuple[int, ...]] = []
        for seq in stop or ():
            if isinstance(seq, int):
                raise ValueError(
                    f"stop must be a list of token sequences; write a single stop token as [{seq}]"
                )
            tokens = tuple(int(t) for t in seq)
            if not tokens:
                raise ValueError("stop: an empty stop sequence")
            bad = [t for t in tokens if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
                )
            stops.append(tokens)
        return cls(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=top_k,
            top_p=float(top_p),
            seed=seed,
            stop=tuple(stops),
            num_samples=num_samples,
            prompt_logprobs=bool(prompt_logprobs),
            logprobs=LogprobOptions.build(
                logprob_options, vocab_size=vocab_size, prompt_logprobs=bool(prompt_logprobs)
            ),
        )


def check_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    max_sequence_length: int,
    max_tokens: int,
    logprobs: LogprobOptions | None = None,
) -> list[list[int]]:
    """The prompts as lists of ints; refuses empty ones, foreign ids, too-long requests and
    logprob options that do not fit a prompt (``LogprobOptions.check_prompt``)."""
    if not isinstance(prompts, Sequence) or isinstance(prompts, str | bytes) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, int | str | bytes):
            raise ValueError(f"prompt {i} must be a list of token ids, not {type(prompt).__name__}")
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
        if len(tokens) + max_tokens > max_sequence_length:
            raise ValueError(
                f"prompt {i}: {len(tokens)} prompt tokens + max_tokens {max_tokens} = "
                f"{len(tokens) + max_tokens} exceeds the model's maxSequenceLength "
                f"{max_sequence_length}"
            )
        if logprobs is not None:
            logprobs.check_prompt(len(tokens), index=i)
        out.append(tokens)
    return out


def row_keys(prompts: Sequence[Sequence[int]], *, seed: int | None, num_samples: int) -> list[int]:
    """One 62-bit noise key per generated row (prompt-major, then sample index).

    The key hashes the seed, the prompt's tokens and the sample index, so a row's noise
    does not depend on the other rows of the call; ``seed=None`` draws a fresh seed.
    """
    base = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
    keys = []
    for prompt in prompts:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(struct.pack("<q", base & 0x7FFFFFFFFFFFFFFF))
        digest.update(struct.pack(f"<{len(prompt)}q", *prompt))
        for i in range(num_samples):
            row = digest.copy()
            row.update(struct.pack("<q", i))
            keys.append(int.from_bytes(row.digest()[:8], "little") & ((1 << 62) - 1))
    return keys
