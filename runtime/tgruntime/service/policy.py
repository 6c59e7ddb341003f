"""Who may touch what: every object of the API (session, model, sampler, future, checkpoint)
is its owner's alone.

An object another principal owns is answered exactly like a missing one (the same 404 and
message), so that its existence leaks nothing. The stores ask the policy; the routes never
compare owners themselves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar


class Owned(Protocol):
    @property
    def owner(self) -> str: ...


T = TypeVar("T", bound=Owned)


class Policy:
    """Ownership: a principal sees and acts on its own objects only."""

    def may_see(self, principal: str, owner: str) -> bool:
        return principal == owner

    def get(self, principal: str, obj: T | None, missing: Callable[[], Exception]) -> T:
        """``obj`` when ``principal`` may use it; else the error of a missing object."""
        if obj is None or not self.may_see(principal, obj.owner):
            raise missing()
        return obj

    def visible(self, principal: str, objs: Iterable[T]) -> list[T]:
        """The objects of a listing that ``principal`` may see."""
        return [o for o in objs if self.may_see(principal, o.owner)]


POLICY = Policy()
