"""Who may touch what: every object of the API (session, model, sampler, future, checkpoint)
is its owner's; admin principals and read grants are the only ways across.

What a principal may do to an object it does not own depends on the act:

=========  =====================================================  ==========================
act        what                                                   besides the owner
=========  =====================================================  ==========================
``use``    train, sample through, heartbeat, poll a future         nobody
``read``   list, ``get_info``, load / sample from / copy a         admins; for a checkpoint,
           checkpoint, ``weights_info``                            the principals it was
                                                                   shared with (its readers)
``delete`` delete a checkpoint, change its TTL                     admins
``finish`` finish a session                                        admins
``share``  grant or revoke read access to a checkpoint             admins
=========  =====================================================  ==========================

An object a principal may not act on is answered exactly like a missing one (the same 404
and message), so that its existence leaks nothing. The stores and routes ask the policy;
they never compare owners themselves. Each time an admin acts on another principal's object
through its admin right, :func:`admin_uses` records the owner for the request's audit line
(service.audit marks the line ``"admin": true``)."""

from __future__ import annotations

import argparse
import contextvars
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from tgruntime.service.auth import valid_principal


class Owned(Protocol):
    @property
    def owner(self) -> str: ...


T = TypeVar("T", bound=Owned)


class Act(enum.Enum):
    USE = "use"
    READ = "read"
    DELETE = "delete"
    FINISH = "finish"
    SHARE = "share"


# the owners an admin acted on during the current request (set per request by the middleware)
_ADMIN_USES: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "tg_admin_uses", default=None
)


def track_admin_uses() -> set[str]:
    """Start recording, for the current request (task), the owners an admin acts on."""
    uses: set[str] = set()
    _ADMIN_USES.set(uses)
    return uses


def admin_uses() -> set[str]:
    """The owners recorded so far for the current request (empty when not recording)."""
    return _ADMIN_USES.get() or set()


@dataclass(frozen=True, kw_only=True)
class Policy:
    """Ownership, admin principals (``spec.api.adminPrincipals``) and read grants."""

    admins: frozenset[str] = field(default_factory=frozenset)

    def may_see(self, principal: str, owner: str) -> bool:
        """Ownership alone (what quotas and a principal's own listings count)."""
        return principal == owner

    def is_admin(self, principal: str) -> bool:
        return principal in self.admins

    def may(
        self, principal: str, owner: str, act: Act = Act.USE, readers: Iterable[str] = ()
    ) -> bool:
        """Whether ``principal`` may ``act`` on an object of ``owner`` (a checkpoint's
        ``readers`` may read it). An admin's use of its right is recorded for the audit."""
        if principal == owner:
            return True
        if act is Act.USE:
            return False
        if act is Act.READ and principal in readers:
            return True
        if principal in self.admins:
            uses = _ADMIN_USES.get()
            if uses is not None:
                uses.add(owner)
            return True
        return False

    def get(
        self,
        principal: str,
        obj: T | None,
        missing: Callable[[], Exception],
        act: Act = Act.USE,
    ) -> T:
        """``obj`` when ``principal`` may ``act`` on it; else the error of a missing object."""
        if obj is None or not self.may(principal, obj.owner, act):
            raise missing()
        return obj

    def visible(self, principal: str, objs: Iterable[T], act: Act = Act.USE) -> list[T]:
        """The objects of a listing that ``principal`` may see (``Act.READ``: an admin's
        listing holds everyone's)."""
        return [o for o in objs if self.may(principal, o.owner, act)]


def parse_admins(text: str | Iterable[str] | None) -> frozenset[str]:
    """``--admin-principals a,b`` (or a list): the names, each a valid principal name."""
    if text is None:
        return frozenset()
    words = text.split(",") if isinstance(text, str) else list(text)
    names = [w.strip() for w in words if w and w.strip()]
    bad = [n for n in names if not valid_principal(n)]
    if bad:
        raise ValueError(
            f"--admin-principals: {bad[0]!r} is not a principal name (1-64 letters, digits, "
            "'.', '_' or '-', not starting with '.', '_' or '-'); give names separated by commas"
        )
    return frozenset(names)


POLICY = Policy()
"""Ownership only (no admins): the futures' check, and the default of a Registry."""


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-principals",
        default=None,
        metavar="A,B",
        help="principals (key names) that may list every principal's runs and checkpoints, "
        "read and delete any checkpoint and finish any session; each such act is audited",
    )


def from_args(args: argparse.Namespace) -> Policy:
    return Policy(admins=parse_admins(getattr(args, "admin_principals", None)))
