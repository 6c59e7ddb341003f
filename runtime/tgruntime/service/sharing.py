"""Finding a checkpoint for a principal: its own, or another's that the policy lets it reach
(an admin's right, or a read grant), and the grants themselves.

A ``tinker://`` path names no principal. It is looked up in the caller's folder first; when
it is not there, in the folder of the principal that owns the run (model ids are unique), and
the policy decides (service.policy): the owner's readers may read it, admins may read and
delete it. Anything else is answered exactly like a missing checkpoint.

Sharing (issue 37): the owner grants one principal read access to one checkpoint path
(``PUT .../checkpoints/{kind}/{name}/readers/{principal}``, service.routes.sharing). The
grant is kept in the checkpoint's sidecar (``readers``), so it survives a restart and goes
with the checkpoint; a new save under the same name starts with no readers. A reader may
load it into its own run, sample from it, read its ``weights_info`` and copy it into its own
folder; it may not delete it, change its TTL or share it on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tgruntime.service.auth import valid_principal
from tgruntime.service.paths import Paths, parse_uri
from tgruntime.service.policy import Act, Policy
from tgruntime.service.sessions import ServiceError

MAX_READERS = 256  # principals one checkpoint may be shared with


@dataclass(frozen=True, kw_only=True)
class Located:
    """A checkpoint the caller may act on: its path's parts, its directory and its owner."""

    uri: str
    model_id: str
    kind: str
    name: str
    dir: Path
    owner: str


class CheckpointAccess:
    def __init__(self, *, paths: Paths, policy: Policy) -> None:
        self.paths = paths
        self.policy = policy

    def locate(self, uri: str, who: str, act: Act = Act.READ) -> Located:
        """The checkpoint ``uri`` when ``who`` may ``act`` on it; else the 404 of a missing
        one (a shared checkpoint's reader asking to delete it gets a 403: it knows it is
        there)."""
        model_id, kind, name = parse_uri(uri)
        try:
            *_, d = self.paths.parse(uri, who)
            return Located(uri=uri, model_id=model_id, kind=kind, name=name, dir=d, owner=who)
        except ServiceError as exc:
            if exc.status != 404:
                raise
            missing = exc
        owner = self.paths.owner_of(model_id)
        if owner is None or owner == who:
            raise missing
        try:
            *_, d = self.paths.parse(uri, owner)
        except ServiceError:
            raise missing from None
        readers = self.paths.readers(d)
        if not self.policy.may(who, owner, act, readers):
            if who in readers:
                raise ServiceError(
                    f"{uri} is shared with you read-only: only its owner can "
                    f"{'share' if act is Act.SHARE else 'delete or change'} it",
                    status=403,
                )
            raise missing
        return Located(uri=uri, model_id=model_id, kind=kind, name=name, dir=d, owner=owner)

    def readers(self, uri: str, who: str) -> tuple[Located, list[str]]:
        """The principals ``uri`` is shared with (its owner and admins may ask)."""
        at = self.locate(uri, who, Act.SHARE)
        return at, sorted(self.paths.readers(at.dir))

    def grant(self, uri: str, who: str, reader: str) -> tuple[Located, list[str]]:
        """Share ``uri`` (of ``who``, or any principal's when ``who`` is an admin) with
        ``reader`` for reading."""
        if not valid_principal(reader):
            raise ServiceError(
                f"principal {reader!r}: a principal name is 1-64 letters, digits, '.', '_' or "
                "'-', not starting with '.', '_' or '-' (the NAME of a 'NAME KEY' line, or of a "
                "keys Secret entry)"
            )
        at = self.locate(uri, who, Act.SHARE)
        if reader == at.owner:
            raise ServiceError(f"{uri} is {reader}'s own checkpoint: there is nothing to share")
        readers = self.paths.readers(at.dir) | {reader}
        if len(readers) > MAX_READERS:
            raise ServiceError(
                f"{uri} is already shared with {MAX_READERS} principals, the limit; revoke one "
                "first"
            )
        self.paths.set_readers(at.dir, readers)
        return at, sorted(readers)

    def revoke(self, uri: str, who: str, reader: str) -> tuple[Located, list[str]]:
        """Stop sharing ``uri`` with ``reader`` (nothing happens when it was not shared)."""
        at = self.locate(uri, who, Act.SHARE)
        readers = self.paths.readers(at.dir) - {reader}
        self.paths.set_readers(at.dir, readers)
        return at, sorted(readers)
