"""Sessions, training runs (models) and the seq_id order of each model's work.

Only soft state lives here (which session holds the group's one full-weight run); weights
and checkpoints live in the group and the checkpoint directory. Every object records its
owner (the principal of the key that created it); lookups go through service.policy, so
another principal's object is answered like a missing one. Ids are 128 random bits.
Sessions that ended (finished, or no heartbeat) are forgotten after ``forget_s``, with
their models and samplers (:meth:`Registry.expire`).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tgapi.errors import PicklableError
from tgruntime.service.policy import POLICY, Act, Policy

DEFAULT_OWNER = "default"
SESSION_ID = re.compile(r"tg-[0-9a-f]{32}")
"""The shape of a session id (:func:`new_id` with ``tg-``); a caller may choose its own in
this shape (the Tinker gateway does, so one session spans its groups: docs/tinker.md)."""


def new_id(prefix: str) -> str:
    """An unguessable id: ``prefix`` and 128 random bits in hex."""
    return f"{prefix}{secrets.token_hex(16)}"


class ServiceError(PicklableError):
    """A request refused with a clear message (HTTP ``status``; ``category`` for futures)."""

    def __init__(self, message: str, *, status: int = 400, category: str = "user") -> None:
        super().__init__(message)
        self.status = status
        self.category = category


class SeqOrder:
    """Admits a model's requests in seq_id order (1, 2, 3, ...).

    A seq_id already admitted is refused at once; one ahead of the next expected waits
    (the SDK may send chunks out of order) up to ``gap_timeout_s``, then is refused."""

    def __init__(self, *, first: int = 1, gap_timeout_s: float = 60.0) -> None:
        self.next = first
        self._cond = asyncio.Condition()
        self._gap_timeout_s = gap_timeout_s

    async def admit(self, seq_id: int) -> None:
        async with self._cond:
            if seq_id < self.next:
                raise ServiceError(
                    f"seq_id {seq_id} is out of order: this model already ran up to seq_id "
                    f"{self.next - 1} (each request needs the next seq_id, {self.next})"
                )
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self.next >= seq_id), self._gap_timeout_s
                )
            except TimeoutError:
                raise ServiceError(
                    f"seq_id {seq_id} waited {self._gap_timeout_s:.0f} s for seq_id "
                    f"{self.next}, which never came"
                ) from None
            if self.next != seq_id:
                raise ServiceError(f"seq_id {seq_id} was already used")

    async def done(self, seq_id: int) -> None:
        async with self._cond:
            if seq_id == self.next:
                self.next += 1
            self._cond.notify_all()


@dataclass
class Model:
    model_id: str
    session_id: str
    base_model: str
    lora_rank: int | None
    created: float = field(default_factory=time.time)
    order: SeqOrder = field(default_factory=SeqOrder)
    retired: str | None = None
    sampler_count: int = 0
    lora_settings: dict[str, Any] | None = None  # a run of a LoRA group: its LoraSettings
    owner: str = DEFAULT_OWNER
    seq: int = 0  # the SDK's model_seq_id in its session
    user_metadata: dict[str, str] | None = None  # create_model's (training_runs answers it)


@dataclass
class Session:
    session_id: str
    tags: list[str]
    metadata: dict[str, Any] | None
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    owner: str = DEFAULT_OWNER
    ended_at: float | None = None  # monotonic: when it was first seen not alive


@dataclass
class SamplingSession:
    sampling_session_id: str
    session_id: str
    weights: str | None  # the group's sampler-weights name; None = current training weights
    model_path: str | None
    base_model: str
    owner: str = DEFAULT_OWNER
    inflight: bool = False  # kind="inflight": the model's shared current weights


class Registry:
    def __init__(
        self, *, session_ttl_s: float = 120.0, forget_s: float = 600.0, policy: Policy | None = None
    ) -> None:
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.policy: Policy = POLICY if policy is None else policy
        self._ttl = session_ttl_s
        self._forget_s = forget_s

    def new_session(
        self,
        tags: list[str],
        metadata: dict[str, Any] | None,
        owner: str = DEFAULT_OWNER,
        session_id: str | None = None,
    ) -> Session:
        """A new session; with ``session_id`` (the gateway's, shape ``tg-`` + 32 hex) that id:
        the owner's own session of that id is answered again (the gateway re-creates it after a
        restart), another principal's is a 409."""
        if session_id is None:
            sid = new_id("tg-")
        elif SESSION_ID.fullmatch(session_id) is None:
            raise ServiceError(
                f"session_id {session_id[:80]!r} is not a session id: 'tg-' and 32 lowercase "
                "hex digits (omit it and the server picks one)"
            )
        else:
            sid = session_id
            held = self.sessions.get(sid)
            if held is not None and held.owner == owner and not held.finished:
                held.last_seen = time.monotonic()
                return held
            if held is not None:
                raise ServiceError(f"session id {sid} is taken: pick another", status=409)
        s = Session(sid, tags, metadata, owner=owner)
        self.sessions[sid] = s
        return s

    def session(
        self, sid: str, principal: str = DEFAULT_OWNER, act: Act = Act.USE
    ) -> Session:
        """The session (kept alive by the lookup, unless an admin acts on another's)."""
        s = self.policy.get(
            principal,
            self.sessions.get(sid),
            lambda: ServiceError(
                f"unknown session {sid!r} (the server may have restarted: "
                "create a new ServiceClient)",
                status=404,
            ),
            act,
        )
        if s.owner == principal:
            s.last_seen = time.monotonic()
        return s

    def alive(self, s: Session) -> bool:
        return not s.finished and time.monotonic() - s.last_seen < self._ttl

    def active_model(self) -> Model | None:
        for m in self.models.values():
            if m.retired is None:
                sess = self.sessions.get(m.session_id)
                if sess is not None and self.alive(sess):
                    return m
        return None

    def add_model(self, model: Model) -> None:
        """One full-weight run per group: a live model of another session refuses this one;
        this session's earlier model is retired (a new client from a saved state replaces
        it)."""
        current = self.active_model()
        if current is not None and current.session_id != model.session_id:
            raise ServiceError(
                f"this group already trains model {current.model_id} (another session, full "
                "weights): a second concurrent full-weight run would overwrite its weights. "
                "Finish that session (or let its heartbeat lapse) first",
                status=409,
            )
        for m in self.models.values():
            if m.retired is not None:
                continue
            if m.session_id == model.session_id:
                m.retired = f"superseded by {model.model_id}"
            else:  # not active, so its session lapsed: a late request must not revive it
                m.retired = (
                    f"its session's heartbeat lapsed and {model.model_id} of another session "
                    "took the group; create a new training client"
                )
        self.models[model.model_id] = model

    def by_seq(self, sid: str, seq: int) -> Model | None:
        """The model a session created with ``model_seq_id`` ``seq``, if any."""
        for m in self.models.values():
            if m.session_id == sid and m.seq == seq:
                return m
        return None

    def model(self, model_id: str, principal: str = DEFAULT_OWNER) -> Model:
        m = self.policy.get(
            principal, self.models.get(model_id), lambda: self._no_model(model_id)
        )
        if m.retired is not None:
            raise ServiceError(
                f"model {model_id} is no longer trained here ({m.retired})", status=410
            )
        self.session(m.session_id, principal)
        return m

    @staticmethod
    def _no_model(model_id: str) -> ServiceError:
        return ServiceError(
            f"unknown model id {model_id!r}: create it with create_model (or "
            "create_training_client_from_state) first; the server may have restarted",
            status=404,
        )

    def owned_model(self, model_id: str, principal: str) -> Model | None:
        """A model of ``principal`` (retired or not) for reading, else None."""
        m = self.models.get(model_id)
        return m if m is not None and self.policy.may_see(principal, m.owner) else None

    def sampler(self, sampler_id: str, principal: str = DEFAULT_OWNER) -> SamplingSession:
        return self.policy.get(
            principal,
            self.samplers.get(sampler_id),
            lambda: ServiceError(
                f"unknown sampler {sampler_id!r} (after a server restart, create the sampling "
                "client again from its tinker:// path)",
                status=404,
            ),
        )

    def readable_model(self, model_id: str, principal: str) -> Model:
        """A model for reading (``get_info``): its owner's as :meth:`model` gives it, and
        another's to an admin (its session untouched); else the 404 of a missing one."""
        m = self.models.get(model_id)
        if m is None or m.owner == principal:
            return self.model(model_id, principal)
        return self.policy.get(principal, m, lambda: self._no_model(model_id), Act.READ)

    def finish(self, sid: str, principal: str = DEFAULT_OWNER) -> None:
        """Its owner, or an admin, ends the session."""
        s = self.session(sid, principal, Act.FINISH)
        s.finished = True
        for m in self.models.values():
            if m.session_id == sid and m.retired is None:
                m.retired = "its session finished"

    def expire(self, held: Iterable[str] = ()) -> list[str]:
        """Forget the sessions not alive for ``forget_s`` and their models and samplers,
        except the models in ``held`` (runs the workers still hold). Returns the session ids
        forgotten."""
        now = time.monotonic()
        gone = []
        for sid, s in list(self.sessions.items()):
            if self.alive(s):
                s.ended_at = None
                continue
            if s.ended_at is None:
                s.ended_at = now
            if now - s.ended_at < self._forget_s:
                continue
            keep = [m for m in self.models.values() if m.session_id == sid and m.model_id in held]
            if keep:
                continue
            gone.append(sid)
            del self.sessions[sid]
        if gone:
            dead = set(gone)
            for mid in [k for k, m in self.models.items() if m.session_id in dead]:
                del self.models[mid]
            for key in [k for k, ss in self.samplers.items() if ss.session_id in dead]:
                del self.samplers[key]
        # samplers and models of sessions forgotten before (or never known) go too
        for mid in [k for k, m in self.models.items() if m.session_id not in self.sessions]:
            if mid not in held:
                del self.models[mid]
        for key in [k for k, ss in self.samplers.items() if ss.session_id not in self.sessions]:
            del self.samplers[key]
        return gone
