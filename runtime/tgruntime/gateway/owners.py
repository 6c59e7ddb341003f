"""What the gateway learned of which group holds which id, from the answers it proxied (and
from asking the groups). Soft state only, bounded (least recently used out): a restarted
gateway, or an id it forgot, asks every group again (gateway.app)."""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field

MAX_IDS = 200_000  # ids remembered (models, samplers, boots) before the oldest are forgotten
MAX_SESSIONS = 50_000


def key_digest(key: str | None) -> str:
    """A digest of the caller's key: which key made a session, never the key itself."""
    return hashlib.sha256((key or "").encode()).hexdigest()


@dataclass(kw_only=True)
class SessionEntry:
    creator: str  # key_digest of the key that created it through this gateway
    body: dict[str, object]  # tags, user_metadata, ... (re-sent to a group that lacks it)
    groups: set[str] = field(default_factory=set)  # groups known to hold it


class Owners:
    def __init__(self, *, max_ids: int = MAX_IDS, max_sessions: int = MAX_SESSIONS) -> None:
        self._ids: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._sessions: collections.OrderedDict[str, SessionEntry] = collections.OrderedDict()
        self._max_ids, self._max_sessions = max_ids, max_sessions

    def learn(self, kind: str, ident: str, group: str) -> None:
        k = (kind, ident)
        self._ids[k] = group
        self._ids.move_to_end(k)
        while len(self._ids) > self._max_ids:
            self._ids.popitem(last=False)

    def owner(self, kind: str, ident: str) -> str | None:
        k = (kind, ident)
        group = self._ids.get(k)
        if group is not None:
            self._ids.move_to_end(k)
        return group

    def forget_group(self, group: str) -> None:
        """A group that left the list: its ids are asked for again if it comes back."""
        for k in [k for k, g in self._ids.items() if g == group]:
            del self._ids[k]
        for s in self._sessions.values():
            s.groups.discard(group)

    def new_session(self, sid: str, entry: SessionEntry) -> None:
        self._sessions[sid] = entry
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    def session(self, sid: str) -> SessionEntry | None:
        s = self._sessions.get(sid)
        if s is not None:
            self._sessions.move_to_end(sid)
        return s

    def end_session(self, sid: str) -> None:
        self._sessions.pop(sid, None)
