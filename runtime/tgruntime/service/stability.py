"""What ``stable_reinforce`` needs from sampling time: the stability records.

A sampling request made with ``record_stability_info=True`` (a sampling client created with
it) is recorded here when it finishes: its prompt, and for each sequence the sampled tokens
and the sampler's log-prob of each (float32, the values the reply carries, kept on the
server so the client cannot alter them). Its sequences are named ``<request id>:<i>``, the
``sequence_id`` the SDK attaches to every ``SampledSequence``.

A record belongs to the principal and the Tinker session that sampled it: a training
request of another session, or of another principal, finds nothing (answered like an id
that never existed). It is kept for ``ttl_s`` (one day) after its last use: each training
request that names one of its sequences restarts the day. The store holds at most
``max_bytes`` (the arrays plus a fixed overhead per record); past that the least recently
used records are dropped first, and a request that could never fit is refused when it is
made. Records live in the server's memory: a restarted server has none (sample again).

:func:`stability_inputs` turns a ``stable_reinforce`` call's datums into the loss's two
per-token tensors, checking every provenance claim against the records first.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tgruntime.service.codec import DatumIn
from tgruntime.service.provenance import Span, check_tiling
from tgruntime.service.sessions import ServiceError

__all__ = [
    "DAY_S",
    "DEFAULT_MAX_BYTES",
    "Sampled",
    "StabilityStore",
    "check_recordable",
    "max_bytes_from_env",
    "sampled_from",
    "stability_inputs",
]

DAY_S = 86_400.0
DEFAULT_MAX_BYTES = 256 * 2**20
_OVERHEAD = 512  # bytes counted per record beside its arrays (ids, dict entry, objects)
_PER_SEQUENCE = 128
UNKNOWN = (
    "has no stability record here: it was not sampled by a sampling client made with "
    "record_stability_info=True in this session, or it was last used more than a day ago, "
    "or dropped for room, or lost in a server restart. Sample with "
    "create_sampling_client(..., record_stability_info=True) (or "
    "save_weights_and_get_sampling_client(record_stability_info=True)) and train on it from "
    "the same session"
)


@dataclass(frozen=True, kw_only=True)
class Sampled:
    """One recorded sampling request: its prompt and, per sequence, the sampled tokens and
    the sampler's log-prob of each."""

    owner: str
    session_id: str
    prompt: np.ndarray  # int32 [P]
    tokens: tuple[np.ndarray, ...]  # int32 [T_i] per sequence
    logprobs: tuple[np.ndarray, ...]  # float32 [T_i] per sequence

    @property
    def nbytes(self) -> int:
        arrays = self.prompt.nbytes + sum(t.nbytes + lp.nbytes
                                          for t, lp in zip(self.tokens, self.logprobs,
                                                           strict=True))
        return int(arrays) + _OVERHEAD + _PER_SEQUENCE * len(self.tokens)


def max_bytes_from_env() -> int:
    """The store's cap: ``TG_STABILITY_MAX_MB`` MiB (default 256)."""
    raw = os.environ.get("TG_STABILITY_MAX_MB", "")
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ValueError(f"TG_STABILITY_MAX_MB must be a number of MiB > 0, got {raw!r}")
    return int(mb * 2**20)


def bound(*, prompt_tokens: int, num_samples: int, max_tokens: int) -> int:
    """The most bytes a request's record can take (every sequence at ``max_tokens``)."""
    return 4 * prompt_tokens + 8 * num_samples * max_tokens + _OVERHEAD + (
        _PER_SEQUENCE * num_samples
    )


class StabilityStore:
    """Records by request id, least recently used first; see the module's docstring."""

    def __init__(
        self,
        *,
        ttl_s: float = DAY_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0 or max_bytes <= 0:
            raise ValueError(f"ttl_s and max_bytes must be > 0, got {ttl_s}, {max_bytes}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._records: OrderedDict[str, tuple[Sampled, float]] = OrderedDict()
        self.bytes = 0
        self.dropped_for_room = 0

    def __len__(self) -> int:
        return len(self._records)

    def check_fits(self, *, prompt_tokens: int, num_samples: int, max_tokens: int) -> None:
        """Refuse, before sampling, a recorded request whose record could exceed the cap."""
        need = bound(prompt_tokens=prompt_tokens, num_samples=num_samples, max_tokens=max_tokens)
        if need > self.max_bytes:
            raise ServiceError(
                f"record_stability_info: this request's record could take {need} bytes "
                f"({num_samples} samples x {max_tokens} max_tokens, {prompt_tokens} prompt "
                f"tokens), over the server's {self.max_bytes}-byte store for stability "
                "records (TG_STABILITY_MAX_MB): sample fewer or shorter sequences per request"
            )

    def record(self, request_id: str, sampled: Sampled) -> None:
        """Keep ``sampled`` under ``request_id``; the oldest records go while over the cap."""
        self.expire()
        old = self._records.pop(request_id, None)
        if old is not None:
            self.bytes -= old[0].nbytes
        self._records[request_id] = (sampled, self._clock())
        self.bytes += sampled.nbytes
        while self.bytes > self.max_bytes and len(self._records) > 1:
            _, (gone, _) = self._records.popitem(last=False)
            self.bytes -= gone.nbytes
            self.dropped_for_room += 1

    def sequence(self, sequence_id: str, *, owner: str, session_id: str) -> tuple[Sampled, int]:
        """The record of ``sequence_id`` and the sequence's index in it, if ``owner``'s
        session ``session_id`` sampled it; using it restarts its day."""
        self.expire()
        rid, _, index = sequence_id.rpartition(":")
        entry = self._records.get(rid)
        i = int(index) if index.isdigit() else -1
        if (
            entry is None
            or entry[0].owner != owner
            or entry[0].session_id != session_id
            or not 0 <= i < len(entry[0].tokens)
        ):
            raise ServiceError(f"sequence_id {sequence_id[:120]!r} {UNKNOWN}")
        self._records.move_to_end(rid)
        self._records[rid] = (entry[0], self._clock())
        return entry[0], i

    def expire(self) -> int:
        """Drop the records unused for ``ttl_s``; how many went."""
        now, n = self._clock(), 0
        while self._records:
            rid, (sampled, used) = next(iter(self._records.items()))
            if now - used < self.ttl_s:
                break
            del self._records[rid]
            self.bytes -= sampled.nbytes
            n += 1
        return n

    def forget_sessions(self, sessions: set[str]) -> int:
        """Drop the records of sessions that are gone (they can train no more)."""
        gone = [rid for rid, (s, _) in self._records.items() if s.session_id in sessions]
        for rid in gone:
            sampled, _ = self._records.pop(rid)
            self.bytes -= sampled.nbytes
        return len(gone)


def check_recordable(
    *, session_id: str | None, temperature: float, top_k: int, top_p: float, vocab: int
) -> str:
    """The session a ``record_stability_info`` request is recorded under; refused when it has
    none, or when its tokens are not drawn from the distribution whose log-probs the sampler
    reports (the model's own, at temperature 1 with no top-k / top-p)."""
    if not session_id:
        raise ServiceError(
            "record_stability_info needs a sampling session (the SDK's sampling clients have "
            "one): records belong to the session that sampled them"
        )
    if temperature != 1.0 or 0 < top_k < vocab or top_p < 1.0:
        raise ServiceError(
            f"record_stability_info with temperature={temperature}, top_k={top_k}, "
            f"top_p={top_p}: this server records the model's own log-probs (temperature 1, "
            "no filtering), which are the sampling distribution only without those options; "
            "sample with temperature 1.0, top_k -1 and top_p 1.0 to train with "
            "stable_reinforce"
        )
    return session_id


def sampled_from(
    *, owner: str, session_id: str, prompt: list[int], sequences: list[dict[str, Any]]
) -> Sampled:
    """A record of a finished request (``sequences``: the reply's dicts, tokens + logprobs)."""
    return Sampled(
        owner=owner,
        session_id=session_id,
        prompt=np.asarray(prompt, np.int32),
        tokens=tuple(np.asarray(s.get("tokens") or (), np.int32) for s in sequences),
        logprobs=tuple(np.asarray(s.get("logprobs") or (), np.float32) for s in sequences),
    )


def _claim(
    store: StabilityStore, span: Span, *, owner: str, session_id: str, datum: int, field: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """The tokens a run claims (and their log-probs for a sampled run), range-checked."""
    sampled, i = store.sequence(span.sequence_id, owner=owner, session_id=session_id)
    source = sampled.prompt if span.kind == "prompt" else sampled.tokens[i]
    end = span.offset + span.length
    if end > source.size:
        raise ServiceError(
            f"datum {datum}: a {field} run claims {span.kind} positions [{span.offset}, {end}) "
            f"of sequence {span.sequence_id!r}, which has {source.size} {span.kind} tokens"
        )
    lps = sampled.logprobs[i][span.offset : end] if span.kind == "sampled" else None
    return source[span.offset : end], lps


def _mismatch(got: np.ndarray, want: np.ndarray, *, at: int, datum: int, field: str,
              span: Span) -> ServiceError:
    k = int(np.flatnonzero(got != want)[0])
    return ServiceError(
        f"datum {datum}: {field} position {at + k} holds token {int(got[k])}, but its run "
        f"names {span.kind} position {span.offset + k} of sequence {span.sequence_id!r}, "
        f"which is token {int(want[k])}: the provenance does not match the data"
    )


def stability_inputs(
    store: StabilityStore,
    data: list[DatumIn],
    *,
    owner: str,
    session_id: str,
    rows: int,
    width: int,
) -> dict[str, torch.Tensor]:
    """``stability_log_probs`` (the recorded sampler log-prob of each target that a sampled
    run names; 0 elsewhere) and ``stability_mask`` (1 there), each ``[rows, width]`` like the
    batch of :func:`tgruntime.service.datum.to_tensors`.

    Every claim is checked: the runs tile their fields; the input tokens are the prompt or
    sampled tokens their runs name; the targets of sampled runs are the sampled tokens (a
    prompt run's targets are not checked: recipes put placeholders there, at weight 0)."""
    logq = np.zeros((rows, width), np.float32)
    mask = np.zeros((rows, width), np.float32)
    for i, d in enumerate(data):
        if d.input_spans is None or d.target_spans is None:
            raise ServiceError(
                f"datum {i}: loss 'stable_reinforce' needs provenance on every datum: sample "
                "with a sampling client made with record_stability_info=True and attach the "
                "sequence_id of each token with Datum.with_provenance(model_input=..., "
                "loss_fn_inputs=...)"
            )
        n = int(d.tokens.size)
        target = d.inputs["target_tokens"]
        if target.shape != (n,):
            raise ServiceError(
                f"datum {i}: loss 'stable_reinforce' takes one target token per position "
                f"(target_tokens [{n}]), got shape {list(target.shape)}"
            )
        check_tiling(d.input_spans, length=n, datum=i, field="model_input")
        check_tiling(d.target_spans, length=n, datum=i, field="loss_fn_inputs")
        at = 0
        for span in d.input_spans:
            want, _ = _claim(store, span, owner=owner, session_id=session_id, datum=i,
                             field="model_input")
            got = d.tokens[at : at + span.length]
            if not np.array_equal(got, want):
                raise _mismatch(got, want, at=at, datum=i, field="model_input", span=span)
            at += span.length
        at = 0
        for span in d.target_spans:
            want, lps = _claim(store, span, owner=owner, session_id=session_id, datum=i,
                               field="loss_fn_inputs")
            if lps is not None:
                got = target[at : at + span.length]
                if not np.array_equal(got, want):
                    raise _mismatch(got, want, at=at, datum=i, field="target_tokens", span=span)
                logq[i, at : at + span.length] = lps
                mask[i, at : at + span.length] = 1.0
            at += span.length
        if not mask[i].any():
            raise ServiceError(
                f"datum {i}: none of its targets is a sampled token (its loss_fn_inputs runs "
                "are all prompt runs): stable_reinforce trains on sampled tokens"
            )
    return {
        "stability_log_probs": torch.from_numpy(logq),
        "stability_mask": torch.from_numpy(mask),
    }
