"""Errors raised while parsing or validating a TrainerGroup spec."""

from __future__ import annotations


class SpecError(ValueError):
    """A TrainerGroup spec is invalid.

    ``field`` is the dotted path of the offending field (``spec.parallelism.tensor``)
    and ``fix`` says what to change; ``str(error)`` combines both into one message.
    """

    def __init__(self, *, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")


class SpecErrors(ValueError):
    """Several spec errors found in one pass (so a user fixes them all at once)."""

    def __init__(self, errors: list[SpecError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"invalid TrainerGroup spec ({len(self.errors)} problem(s)):\n{lines}")
