"""One vocabulary for a worker's state and one summary of why it died.

``tgctl status`` (reading the GCS), the controller's health check and the operator's
``status.workers`` (reading Ray's State API) all describe workers with these, so ``kubectl``
and ``tgctl`` say the same words about the same dead worker. Ray's death cause arrives as
the same nested record on both paths (``{"actor_died_error_context": {"reason": ...,
"error_message": ...}}``); :func:`death_cause_text` turns it into one line.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any


class WorkerState(enum.StrEnum):
    ALIVE = "ALIVE"
    DEAD = "DEAD"
    """The actor died; the cause says why (Ray's record)."""
    NOT_FOUND = "NOT_FOUND"
    """No actor of that name in the group's Ray namespace (never created, or removed)."""
    UNREACHABLE = "UNREACHABLE"
    """The actor exists but is not ALIVE (pending, restarting), or it did not answer."""


NOT_FOUND_CAUSE = "no such actor in the Ray namespace (never created, or removed)"
NO_CAUSE = "the actor died (Ray gave no cause)"


def _meaningful_line(text: str) -> str:
    """A traceback's last line, else a message's first (lines with no letters or digits
    skipped); at most 500 characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if any(c.isalnum() for c in ln)]
    if not lines:
        return ""
    return (lines[-1] if lines[0].startswith("Traceback") else lines[0])[:500]


def death_cause_text(cause: Any) -> str:
    """Ray's death-cause record as one line ("" when there is none).

    The error message's meaningful line, then Ray's reason code in brackets when it has one:
    ``The actor is dead because it was killed by `ray.kill`. [RAY_KILL]``.
    """
    if not cause:
        return ""
    if isinstance(cause, str):
        return _meaningful_line(cause)
    if not isinstance(cause, Mapping):
        return str(cause)
    message = cause.get("error_message") or cause.get("errorMessage")
    reason = cause.get("reason")
    if isinstance(message, str) or isinstance(reason, str):
        line = _meaningful_line(message) if isinstance(message, str) else ""
        code = str(reason).strip() if isinstance(reason, str) else ""
        return f"{line} [{code}]" if line and code else (line or code)
    for value in cause.values():  # the one "*_context" entry
        found = death_cause_text(value)
        if found:
            return found
    return ""


def describe_worker(*, ray_state: str | None, death_cause: Any = None) -> tuple[WorkerState, str]:
    """A worker's state and cause from its actor's Ray state (None: no such actor)."""
    if ray_state is None:
        return WorkerState.NOT_FOUND, NOT_FOUND_CAUSE
    if ray_state == "ALIVE":
        return WorkerState.ALIVE, ""
    if ray_state == "DEAD":
        return WorkerState.DEAD, death_cause_text(death_cause) or NO_CAUSE
    return WorkerState.UNREACHABLE, f"actor is {ray_state}"


def is_dead(state: str) -> bool:
    """Gone for good (DEAD or NOT_FOUND): the group must be re-created."""
    return state in (WorkerState.DEAD, WorkerState.NOT_FOUND)
