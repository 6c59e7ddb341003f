"""Errors raised while parsing or validating a TrainerGroup spec, and the base every project
error class shares so that it survives pickling (:class:`PicklableError`)."""

from __future__ import annotations

from typing import Any

__all__ = ["PicklableError", "SpecError", "SpecErrors"]


class PicklableError(Exception):
    """Mixin base (put it first among the bases) for exceptions that must survive pickling.

    ``BaseException.__reduce__`` rebuilds an exception as ``cls(*self.args)``: that breaks as
    soon as ``__init__`` takes keyword-only or other arguments than the message (the
    unpickling raises a ``TypeError``, or silently builds a different message). An error
    raised on a Ray worker is pickled there and unpickled in the caller, so such a class
    reaches the caller as Ray's ``UnserializableException`` instead of itself.

    Here the copy is rebuilt without calling ``__init__``: a bare instance of the same class
    gets the original ``args`` and instance ``__dict__`` (every attribute ``__init__`` set:
    group, rank, cause..., and ``__notes__``), so ``type``, ``str()`` and the attributes
    survive whatever the constructor's signature. The attributes themselves must be
    picklable. ``__cause__``, ``__context__`` and ``__traceback__`` are not kept (as with any
    pickled exception).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.args), dict(self.__dict__) or None)


def _rebuild_error(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    error = cls.__new__(cls, *args)  # OSError subclasses fill errno/strerror from args here
    error.args = args
    return error


class SpecError(PicklableError, ValueError):
    """A TrainerGroup spec is invalid.

    ``field`` is the dotted path of the offending field (``spec.parallelism.tensor``)
    and ``fix`` says what to change; ``str(error)`` combines both into one message.
    """

    def __init__(self, *, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class SpecErrors(PicklableError, ValueError):
    """Several spec errors found in one pass (so a user fixes them all at once)."""

    def __init__(self, errors: list[SpecError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid TrainerGroup spec ({len(self.errors)} problem(s)):\n{lines}")
