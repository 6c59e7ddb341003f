"""``LogprobOptions``: what a sample request asks to be scored besides its sampled tokens.

These are the logprob fields of the Tinker SDK's ``SampleRequest`` (tinker 0.38), under the
same names, checked once (by the service at once, and again on every rank before any
collective, so all ranks refuse together). Pure Python: the service imports it without
torch or megatron.

* ``topk_prompt_logprobs`` k: the k most likely tokens (and their log-probs) at every scored
  prompt position;
* ``topk_sample_logprobs`` k: the same at every sampled position;
* ``prompt_logprobs_last_n`` N: only the last N prompt tokens are scored (``prompt_logprobs``
  and ``topk_prompt_logprobs``), so the sampler computes no output layer over the prefix;
* ``prompt_alt_tokens_k`` k: k draws, at the request's temperature, from the model's
  next-token distribution at every prompt position after the first;
* ``target_prompt_logprobs``: ``[len(prompt) - 1, K]`` token ids (``-1``: nothing), whose
  log-probs are returned at prompt position ``row + 1``.

Every log-prob is the model's own (``log_softmax`` of the raw logits, temperature 1), as the
sampled tokens' are (``sampling/select.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_TARGET_CELLS", "MAX_WIDTH", "LogprobOptions"]

MAX_WIDTH = 64
"""The widest ``topk_prompt_logprobs``, ``topk_sample_logprobs`` and ``prompt_alt_tokens_k``."""

MAX_TARGET_CELLS = 1 << 20
"""At most this many cells (rows x K) in ``target_prompt_logprobs``."""

_FIELDS = frozenset(
    {
        "topk_prompt_logprobs",
        "topk_sample_logprobs",
        "prompt_logprobs_last_n",
        "prompt_alt_tokens_k",
        "target_prompt_logprobs",
    }
)


def _width(raw: Mapping[str, Any], name: str, vocab_size: int) -> int:
    value = raw.get(name) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0 (0: off), not {value!r}")
    limit = min(MAX_WIDTH, vocab_size)
    if value > limit:
        raise ValueError(
            f"{name} {value} is over this server's limit of {limit} (the smaller of "
            f"{MAX_WIDTH} and the vocabulary size): ask for at most {limit}"
        )
    return value


def _target(value: Any, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    name = "target_prompt_logprobs"
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not value:
        raise ValueError(f"{name} must be a non-empty [len(prompt) - 1, K] list of token-id rows")
    rows: list[tuple[int, ...]] = []
    for i, row in enumerate(value):
        if not isinstance(row, Sequence) or isinstance(row, str | bytes):
            raise ValueError(f"{name} row {i} must be a list of K token ids (-1: none)")
        cells = tuple(int(t) for t in row)
        if rows and len(cells) != len(rows[0]):
            raise ValueError(
                f"{name} row {i} has {len(cells)} ids, row 0 has {len(rows[0])}: every row "
                "has K cells (pad with -1)"
            )
        bad = [t for t in cells if not -1 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"{name} id {bad[0]} (row {i}) is outside the vocabulary [0, {vocab_size}) "
                "and not -1 (no target)"
            )
        rows.append(cells)
    k = len(rows[0])
    if k == 0:
        raise ValueError(f"{name} has K = 0 columns: name at least one id")
    if len(rows) * k > MAX_TARGET_CELLS:
        raise ValueError(
            f"{name} has {len(rows)} x {k} = {len(rows) * k} cells, over this server's limit "
            f"of {MAX_TARGET_CELLS}: split the prompt's positions over several requests"
        )
    if all(t < 0 for row in rows for t in row):
        raise ValueError(f"{name} names no token id (every cell is -1): name at least one")
    return tuple(rows)


@dataclasses.dataclass(frozen=True)
class LogprobOptions:
    """One request's logprob options (defaults: none asked)."""

    topk_prompt: int = 0
    topk_sample: int = 0
    last_n: int | None = None
    alt_k: int = 0
    target: tuple[tuple[int, ...], ...] | None = None  # [len(prompt) - 1, K]; -1: none

    @classmethod
    def build(
        cls, raw: Mapping[str, Any] | None, *, vocab_size: int, prompt_logprobs: bool
    ) -> LogprobOptions:
        """From the SDK-named fields of ``raw`` (None: no options); refusals name the field."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"logprob_options must be a dict of {sorted(_FIELDS)}, not {raw!r}")
        unknown = set(raw) - _FIELDS
        if unknown:
            raise ValueError(f"logprob_options: unknown fields {sorted(unknown)}")
        last_n = raw.get("prompt_logprobs_last_n")
        if last_n is not None:
            if isinstance(last_n, bool) or not isinstance(last_n, int) or last_n < 1:
                raise ValueError(
                    f"prompt_logprobs_last_n must be an integer >= 1 or None, not {last_n!r}"
                )
            if not prompt_logprobs:
                raise ValueError(
                    "prompt_logprobs_last_n applies to prompt logprobs: set prompt_logprobs "
                    "(the SDK's include_prompt_logprobs=True) or drop it"
                )
        target = raw.get("target_prompt_logprobs")
        return cls(
            topk_prompt=_width(raw, "topk_prompt_logprobs", vocab_size),
            topk_sample=_width(raw, "topk_sample_logprobs", vocab_size),
            last_n=last_n,
            alt_k=_width(raw, "prompt_alt_tokens_k", vocab_size),
            target=None if target is None else _target(target, vocab_size),
        )

    def check_prompt(self, length: int, *, index: int = 0) -> None:
        """Refuse options that do not fit prompt ``index`` of ``length`` tokens."""
        if self.last_n is not None and self.last_n > length - 1:
            raise ValueError(
                f"prompt {index}: prompt_logprobs_last_n {self.last_n} is over "
                f"len(prompt) - 1 = {length - 1} (the first token has no logprob)"
            )
        if self.target is not None and len(self.target) != length - 1:
            raise ValueError(
                f"prompt {index}: target_prompt_logprobs has {len(self.target)} rows; a "
                f"{length}-token prompt needs len(prompt) - 1 = {length - 1} (row i scores "
                "prompt position i + 1)"
            )

    @property
    def scores_prompt(self) -> bool:
        """Whether anything but ``prompt_logprobs`` needs the prompt's output layer."""
        return bool(self.topk_prompt or self.alt_k or self.target is not None)

    def first_row(self, length: int, *, prompt_logprobs: bool) -> int | None:
        """The first prefill position whose logits are needed (position ``t`` predicts prompt
        token ``t + 1``), or None when no prompt position is scored: ``prompt_logprobs_last_n``
        lets the prefix before it go without any output layer."""
        if length < 2:
            return None
        starts: list[int] = []
        if prompt_logprobs or self.topk_prompt:
            n = self.last_n if self.last_n is not None else length - 1
            starts.append(length - 1 - n)
        if self.alt_k:
            starts.append(0)
        if self.target is not None:
            starts.append(next(i for i, row in enumerate(self.target) if any(t >= 0 for t in row)))
        return min(starts) if starts else None

    def as_request(self) -> dict[str, Any] | None:
        """The SDK-named dict ``build`` reads (None when nothing is asked)."""
        if self == LogprobOptions():
            return None
        out: dict[str, Any] = {}
        if self.topk_prompt:
            out["topk_prompt_logprobs"] = self.topk_prompt
        if self.topk_sample:
            out["topk_sample_logprobs"] = self.topk_sample
        if self.last_n is not None:
            out["prompt_logprobs_last_n"] = self.last_n
        if self.alt_k:
            out["prompt_alt_tokens_k"] = self.alt_k
        if self.target is not None:
            out["target_prompt_logprobs"] = [list(r) for r in self.target]
        return out
