"""Stop strings: the group's sampler stops on token sequences only, so the server turns each
stop string into its exact encoding (when that encoding decodes back to the string) for the
sampler to halt early, and cuts every sampled sequence at the first token whose incremental
decoding completes a stop string. The stop string's tokens are kept and ``stop_reason`` is
``"stop"``, as Tinker/vLLM-style engines return them (docs/tinker.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("tgruntime.service")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def load_tokenizer(path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(path)
    return tok  # type: ignore[no-any-return]


def eos_token_ids(tok: Any, directory: str | Path | None = None) -> tuple[int, ...]:
    """The ids that end a sequence for ``stop=None``: the tokenizer's ``eos_token_id`` and
    every id of ``generation_config.json``'s ``eos_token_id`` in ``directory`` (an int or a
    list, as Llama 3 and Qwen3 instruct checkpoints list several), in that order."""
    ids: list[int] = []
    eos = getattr(tok, "eos_token_id", None)
    if isinstance(eos, int) and not isinstance(eos, bool):
        ids.append(eos)
    gen = Path(directory) / "generation_config.json" if directory is not None else None
    if gen is not None and gen.is_file():
        try:
            value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            value = None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.append(v)
    return tuple(dict.fromkeys(ids))


def eos_from_dir(directory: str | Path) -> tuple[int, ...]:
    """:func:`eos_token_ids` of the tokenizer in ``directory`` (loaded here); () when it does
    not load (the server then says so on the first stop-string request)."""
    try:
        tok = load_tokenizer(str(directory))
    except Exception as exc:
        log.warning("cannot read EOS ids from the tokenizer at %s: %s", directory, exc)
        return ()
    return eos_token_ids(tok, directory)


def _decode(tok: Tokenizer, ids: Sequence[int]) -> str:
    return tok.decode(list(ids), skip_special_tokens=False)


def token_stops(tok: Tokenizer, strings: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The stop strings whose exact encoding decodes back to them, as token sequences."""
    out: list[tuple[int, ...]] = []
    for s in strings:
        ids = tok.encode(s, add_special_tokens=False)
        if ids and _decode(tok, ids) == s:
            out.append(tuple(int(i) for i in ids))
    return tuple(out)


def stop_at(tok: Tokenizer, tokens: Sequence[int], strings: Sequence[str]) -> int | None:
    """How many tokens to keep: up to and including the first token whose decoded prefix
    contains a stop string; None when no stop string occurs in the decoded sequence."""
    if not strings or not tokens:
        return None

    def hit(n: int) -> bool:
        text = _decode(tok, tokens[:n])
        return any(s in text for s in strings)

    if not hit(len(tokens)):
        return None
    # the first prefix that completes a stop string: binary search (a decoded prefix is a
    # prefix of the longer decoding), then step back over any non-monotone decoding
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    while lo > 1 and hit(lo - 1):
        lo -= 1
    return lo


def cut_sequences(
    tok: Tokenizer, sequences: list[dict[str, Any]], strings: Sequence[str]
) -> list[dict[str, Any]]:
    """Each sequence cut at its first stop string: tokens, logprobs (and top-k) together."""
    out = []
    for s in sequences:
        n = stop_at(tok, s["tokens"], strings)
        if n is None:
            out.append(s)
            continue
        cut = {
            **s,
            "tokens": list(s["tokens"])[:n],
            "logprobs": list(s["logprobs"])[:n],
            "stop_reason": "stop",
        }
        if "topk_logprobs" in s:  # topk_sample_logprobs: one row per token
            cut["topk_logprobs"] = list(s["topk_logprobs"])[:n]
        out.append(cut)
    return out
