"""Failures of a TrainerGroup, as kopf errors.

A :class:`GroupFailed` subclass is permanent: the phase is Failed and kopf stops
retrying until the spec changes. Each carries the condition ``reason`` the status
shows. Waiting is not an error: the reconcile pass returns a wait and the group's
loop looks again later.
"""

from __future__ import annotations

import kopf


class GroupFailed(kopf.PermanentError):
    """The group cannot reach Ready without a change to its spec or its cluster."""

    reason = "Failed"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClusterConflict(GroupFailed):
    reason = "ClusterConflict"


class ClusterTimeout(GroupFailed):
    reason = "ClusterTimeout"


class WorkersTimeout(GroupFailed):
    reason = "WorkersTimeout"


class ServerFailed(GroupFailed):
    reason = "ServerFailed"


class WorkerDied(GroupFailed):
    reason = "WorkerDied"


class RestartLimit(GroupFailed):
    reason = "RestartLimit"


class TokenSecretInvalid(GroupFailed):
    """The operator cannot make the group's Ray token (no key configured)."""

    reason = "NoTokenKey"


class ClaimAccessMode(GroupFailed):
    """The checkpoint claim's access mode cannot serve the pods that mount it
    (tg_operator.claims)."""

    reason = "ClaimAccessMode"
