"""Quotas and limits of the Tinker API (issue 37): per request and per principal.

Per request (sizes: waiting does not help, so never 429):
  * the body (``--max-body-mb``): HTTP 413;
  * ``num_samples`` and ``max_tokens`` of a sample: HTTP 400;
  * datums of one ``forward``/``forward_backward``: the request's future fails (it keeps its
    seq_id turn, so the training client's next request is not stuck behind it). The server
    also tells the SDK (``client/config``: ``fwdbwd_max_chunk_len``) to split its calls under
    this limit, so the SDK never meets it.

Per principal:
  * training runs on a LoRA group (``--max-runs-per-principal``): ``create_model`` answers a
    failed future (the SDK raises at once); it clears when the principal ends a session;
  * live sampling sessions (``--max-sampling-sessions``): HTTP 403, not retried by the SDK;
  * queued requests (``--max-queued-requests``): requests accepted and not finished; HTTP 429
    with ``Retry-After``, which the SDK retries (it clears as the queue drains). A training
    request that is its model's next seq_id is always admitted: the requests queued behind it
    wait for it, so refusing it could only stall them;
  * sampled tokens per minute (``--sampled-tokens-per-minute``, 0: off): a bucket of one
    minute's tokens refilled continuously; a sample is admitted while the bucket is not
    empty and charged the tokens it actually sampled when it finishes (so ``max_tokens``
    headroom costs nothing); an empty bucket answers HTTP 429 with the seconds until it
    refills in ``Retry-After``.

Every refusal names the limit, its value and the setting that raises it. Settings: flags of
``python -m tgruntime.service`` / ``tgctl serve``, each with a ``TG_TINKER_*`` environment
variable as its default (:data:`SETTINGS`). Pure logic here; the routes call it.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from tgruntime.service.sessions import ServiceError

__all__ = ["SETTINGS", "LimitError", "Limits", "TokenRate", "add_flags"]

MiB = 1 << 20


class LimitError(ServiceError):
    """A request refused by a quota or limit: ``limit`` (its name), ``value``, ``setting``
    (what raises it), ``retry_after`` (seconds, for HTTP 429; None when waiting won't help)."""

    def __init__(
        self,
        message: str,
        *,
        limit: str,
        value: int,
        setting: str,
        status: int = 400,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status=status, category="user")
        self.limit = limit
        self.value = value
        self.setting = setting
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, at least 1) when retrying makes sense."""
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


@dataclass(frozen=True)
class Limits:
    """The server's limits (0: no limit). Defaults are meant for a group shared by a few
    teams; see docs/tinker.md for the table."""

    max_body_mb: int = 64
    max_num_samples: int = 128
    max_tokens: int = 16384
    max_datums: int = 1024
    max_runs_per_principal: int = 4
    max_sampling_sessions: int = 256
    max_queued_requests: int = 1024
    sampled_tokens_per_minute: int = 0

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mb * MiB if self.max_body_mb > 0 else 1 << 40

    # -- per request ------------------------------------------------------------------
    def check_sample(self, num_samples: int, max_tokens: int) -> None:
        if self.max_num_samples and num_samples > self.max_num_samples:
            raise _over("num_samples", num_samples, self.max_num_samples, "max_num_samples")
        if self.max_tokens and max_tokens > self.max_tokens:
            raise _over("max_tokens", max_tokens, self.max_tokens, "max_tokens")

    def check_datums(self, n: int) -> None:
        if self.max_datums and n > self.max_datums:
            raise _over("datums in one request", n, self.max_datums, "max_datums",
                        hint="split the batch into several forward_backward calls")

    def body_error(self, size: int | None) -> LimitError:
        got = f"{size} bytes" if size is not None else "more"
        return LimitError(
            f"the request body ({got}) exceeds the server's limit of {self.max_body_mb} MiB "
            f"per request ({flag('max_body_mb')}); send less per request (fewer datums "
            "per forward_backward call)",
            limit="request body", value=self.max_body_mb, setting=flag("max_body_mb"),
            status=413,
        )

    # -- per principal ----------------------------------------------------------------
    def check_runs(self, who: str, held: int) -> None:
        if self.max_runs_per_principal and held >= self.max_runs_per_principal:
            raise _quota(
                who, "training runs", held, self.max_runs_per_principal,
                "max_runs_per_principal",
                "finish a session that holds one (ServiceClient's close, or let its heartbeat "
                "lapse)",
            )

    def check_sampling_sessions(self, who: str, live: int) -> None:
        if self.max_sampling_sessions and live >= self.max_sampling_sessions:
            raise _quota(
                who, "sampling sessions", live, self.max_sampling_sessions,
                "max_sampling_sessions",
                "finish the sessions that hold them (ServiceClient's close); a new "
                "ServiceClient starts from none",
                status=403,
            )

    def check_queued(self, who: str, queued: int) -> None:
        if self.max_queued_requests and queued >= self.max_queued_requests:
            raise LimitError(
                f"principal {who!r} has {queued} requests queued, its limit "
                f"({flag('max_queued_requests')} {self.max_queued_requests}); retry once "
                "some have finished (the SDK retries this answer by itself)",
                limit="queued requests", value=self.max_queued_requests,
                setting=flag("max_queued_requests"), status=429, retry_after=1.0,
            )


def _over(what: str, got: int, value: int, name: str, *, hint: str = "") -> LimitError:
    tail = f"; {hint}" if hint else ""
    return LimitError(
        f"{what} {got} exceeds the server's limit of {value} per request ({flag(name)}){tail}",
        limit=what, value=value, setting=flag(name),
    )


def _quota(
    who: str, what: str, held: int, value: int, name: str, fix: str, *, status: int = 400
) -> LimitError:
    return LimitError(
        f"principal {who!r} holds {held} {what}, its limit ({flag(name)} {value}): {fix}, "
        f"or ask the admin to raise {flag(name)}",
        limit=what, value=value, setting=flag(name), status=status,
    )


@dataclass
class _Bucket:
    tokens: float
    at: float


@dataclass
class TokenRate:
    """Sampled tokens per minute per principal: admitted while the principal's bucket is not
    empty, charged the sampled tokens at the end (the bucket may go below zero; it refills at
    ``per_minute / 60`` tokens a second up to ``per_minute``)."""

    per_minute: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def _bucket(self, who: str) -> _Bucket:
        now = self.clock()
        b = self._buckets.get(who)
        if b is None:
            b = self._buckets[who] = _Bucket(float(self.per_minute), now)
        b.tokens = min(float(self.per_minute), b.tokens + (now - b.at) * self.per_minute / 60)
        b.at = now
        return b

    def admit(self, who: str) -> None:
        if self.per_minute <= 0:
            return
        b = self._bucket(who)
        if b.tokens > 0:
            return
        wait = (1 - b.tokens) * 60 / self.per_minute
        raise LimitError(
            f"principal {who!r} sampled more than its {self.per_minute} tokens per minute "
            f"({flag('sampled_tokens_per_minute')}); retry in {math.ceil(wait)} s (the SDK "
            "retries this answer by itself)",
            limit="sampled tokens per minute", value=self.per_minute,
            setting=flag("sampled_tokens_per_minute"), status=429, retry_after=wait,
        )

    def charge(self, who: str, tokens: int) -> None:
        if self.per_minute > 0 and tokens > 0:
            self._bucket(who).tokens -= tokens

    def left(self, who: str) -> float:
        return self._bucket(who).tokens if self.per_minute > 0 else math.inf


# -- settings: flags with TG_TINKER_* environment defaults --------------------------------
SETTINGS: dict[str, tuple[str, str]] = {
    # field: (environment variable, help)
    "max_body_mb": ("TG_TINKER_MAX_BODY_MB", "largest request body, MiB (HTTP 413)"),
    "max_num_samples": ("TG_TINKER_MAX_NUM_SAMPLES", "num_samples of one sample request"),
    "max_tokens": ("TG_TINKER_MAX_TOKENS", "max_tokens of one sample request"),
    "max_datums": ("TG_TINKER_MAX_DATUMS", "datums of one forward/forward_backward request"),
    "max_runs_per_principal": (
        "TG_TINKER_MAX_RUNS_PER_PRINCIPAL", "training runs one principal holds (LoRA group)"
    ),
    "max_sampling_sessions": (
        "TG_TINKER_MAX_SAMPLING_SESSIONS", "live sampling sessions of one principal"
    ),
    "max_queued_requests": (
        "TG_TINKER_MAX_QUEUED_REQUESTS", "unfinished requests of one principal (HTTP 429)"
    ),
    "sampled_tokens_per_minute": (
        "TG_TINKER_SAMPLED_TOKENS_PER_MINUTE", "sampled tokens per minute of one principal"
    ),
}


def flag(name: str) -> str:
    """The flag (and environment variable) that sets ``name``."""
    return f"--{name.replace('_', '-')} / {SETTINGS[name][0]}"


def from_env(env: Mapping[str, str] | None = None) -> Limits:
    env = os.environ if env is None else env
    values: dict[str, int] = {}
    for f in fields(Limits):
        raw = env.get(SETTINGS[f.name][0], "").strip()
        if raw:
            try:
                values[f.name] = int(raw)
            except ValueError:
                raise ValueError(f"{SETTINGS[f.name][0]}={raw!r} is not an integer") from None
    return Limits(**values)


def add_flags(p: argparse.ArgumentParser) -> None:
    """The limit flags (default: the environment variable, else :class:`Limits`' default)."""
    base = from_env()
    g = p.add_argument_group("limits (0: none; docs/tinker.md)")
    for f in fields(Limits):
        env, text = SETTINGS[f.name]
        default = getattr(base, f.name)
        g.add_argument(
            f"--{f.name.replace('_', '-')}", type=int, default=default,
            help=f"{text} (default {default}; {env})",
        )


def from_args(args: argparse.Namespace) -> Limits:
    return Limits(**{f.name: int(getattr(args, f.name)) for f in fields(Limits)})
