"""Expiring signed links to a checkpoint's archive, or to one file of an external-weights
checkpoint (issue 38: what ``tinker_cookbook.weights.download`` fetches).

A link names what it opens and until when, and carries an HMAC-SHA256 of exactly that under a
secret only the server knows, so it needs no API key: whoever holds the link may fetch that one
checkpoint until it expires, and nothing else. The server issues a link only to a principal that
may read the checkpoint (its owner, a reader it was shared with, an admin: service.policy and
service.sharing); the link names the folder (the owner) it was issued for, so a link cannot be
bent to another principal's checkpoint of the same path.

The query of a link: ``owner``, ``path`` (the ``tinker://`` path), ``file`` (a file link only:
the file's path inside the checkpoint), ``expires`` (epoch seconds, an integer) and
``signature`` (64 hex digits). Changing any of them breaks the signature; the signature also
covers the link's scope (``archive`` or ``file``), so a link of one route opens nothing on the
other.

The secret is ``TG_TINKER_LINK_SECRET`` (any text, e.g. from a Secret; every replica and restart
that shares it honours the others' links), else 32 random bytes drawn when the server starts
(a restart then voids the links it had issued: ask for a new one)."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
import urllib.parse
from dataclasses import dataclass, field

from tgruntime.service.sessions import ServiceError

ENV_SECRET = "TG_TINKER_LINK_SECRET"
LINK_TTL_S = 900  # how long a link is valid: 15 minutes, as hosted Tinker's archive links
MAX_LINK_TTL_S = 7 * 24 * 3600
ARCHIVE_ROUTE = "/signed/archive"  # outside /api/v1: the signature is the credential
FILE_ROUTE = "/signed/file"
SCOPES = ("archive", "file")


def _secret_from_env() -> bytes:
    raw = os.environ.get(ENV_SECRET, "")
    return raw.encode() if raw else secrets.token_bytes(32)


@dataclass(frozen=True, kw_only=True)
class Link:
    """What a valid link opens: ``path`` in ``owner``'s folder (its ``file``, for a file
    link), until ``expires``."""

    owner: str
    path: str
    expires: int
    file: str = ""


@dataclass(frozen=True, kw_only=True)
class LinkSigner:
    """Signs and checks links; ``secret`` is the server's (never sent anywhere)."""

    secret: bytes = field(default_factory=_secret_from_env, repr=False)
    ttl_s: int = LINK_TTL_S

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError(
                f"{ENV_SECRET} must hold at least 16 bytes (a long random text); it has "
                f"{len(self.secret)}. Unset it and the server draws a random one at start"
            )
        if not 1 <= self.ttl_s <= MAX_LINK_TTL_S:
            raise ValueError(f"link ttl_s must be 1 to {MAX_LINK_TTL_S} seconds, not {self.ttl_s}")

    def _mac(self, *, scope: str, owner: str, path: str, file: str, expires: int) -> str:
        msg = "\n".join(("tg-link-v1", scope, owner, path, file, str(expires))).encode()
        return hmac.new(self.secret, msg, hashlib.sha256).hexdigest()

    def sign(
        self, *, owner: str, path: str, file: str = "", now: float | None = None
    ) -> tuple[str, int]:
        """(the link's query string, its expiry in epoch seconds): an archive link, or with
        ``file`` a link to that one file."""
        expires = int(time.time() if now is None else now) + self.ttl_s
        scope = "file" if file else "archive"
        fields: dict[str, str | int] = {"owner": owner, "path": path}
        if file:
            fields["file"] = file
        fields["expires"] = expires
        fields["signature"] = self._mac(
            scope=scope, owner=owner, path=path, file=file, expires=expires
        )
        return urllib.parse.urlencode(fields), expires

    def check(
        self, query: dict[str, str], *, scope: str = "archive", now: float | None = None
    ) -> Link:
        """The link the query opens on a ``scope`` route; a 403 naming what is wrong
        (tampered, expired, not a link of this server or of this route) otherwise."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
        need = ("owner", "path", "expires", "signature") + (("file",) if scope == "file" else ())
        missing = [k for k in need if not query.get(k)]
        if missing:
            raise ServiceError(
                f"not a signed link of this server: it lacks {', '.join(missing)}; ask for a "
                "new link (GET /api/v1/training_runs/<run>/checkpoints/<kind>/<name>/archive)",
                status=403,
            )
        owner, path, raw = query["owner"], query["path"], query["expires"]
        file = query.get("file", "") if scope == "file" else ""
        try:
            expires = int(raw)
        except ValueError:
            expires = -1
        want = self._mac(scope=scope, owner=owner, path=path, file=file, expires=expires)
        if expires < 0 or not hmac.compare_digest(want, query["signature"]):
            raise ServiceError(
                "the link's signature does not match what it names (it was altered, or "
                f"issued by a server with another {ENV_SECRET}, or before a restart): ask "
                "for a new link",
                status=403,
            )
        now = time.time() if now is None else now
        if expires <= now:
            raise ServiceError(
                f"the link expired {int(now - expires)} s ago (links last {self.ttl_s} s): ask "
                "for a new link",
                status=403,
            )
        return Link(owner=owner, path=path, expires=expires, file=file)
