"""Clients' view of a TrainerGroup in Kubernetes: read its status, wait (a watch) until Ready.

Needs the ``kubernetes`` client (the ``client`` extra); ``import tgapi`` alone does not import
this subpackage. Used by ``tg-client`` (``tgruntime.client``), its ``wait`` subcommand and the
tests; never by the operator's reconcile loop (kopf does its own watching).
"""

from tgapi.client.kube import (
    api_client,
    default_k8s_namespace,
    get_trainergroup,
    read_status,
    wait_for_ready,
    wait_until,
)
from tgapi.client.ready import (
    ReadyGroup,
    TrainerGroupFailed,
    TrainerGroupForbidden,
    TrainerGroupNotFound,
    TrainerGroupNotReady,
    is_failed,
    is_ready,
    ready_deadline,
)

__all__ = [
    "ReadyGroup",
    "TrainerGroupFailed",
    "TrainerGroupForbidden",
    "TrainerGroupNotFound",
    "TrainerGroupNotReady",
    "api_client",
    "default_k8s_namespace",
    "get_trainergroup",
    "is_failed",
    "is_ready",
    "read_status",
    "ready_deadline",
    "wait_for_ready",
    "wait_until",
]
