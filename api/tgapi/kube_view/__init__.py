"""A TrainerGroup as its clients see it in Kubernetes: read its status, wait (a watch) until
Ready, and where to attach (the Ray address and namespace of a Ready group).

Needs the ``kubernetes`` client (the ``client`` extra); ``import tgapi`` alone does not import
this subpackage. Used by ``tg-client`` (``tgruntime.entrypoints.client_job``), its ``wait``
subcommand, ``TrainerClient`` and the tests; never by the operator's reconcile loop (kopf does
its own watching).
"""

from tgapi.kube_view.kube import (
    api_client,
    default_k8s_namespace,
    get_trainergroup,
    read_status,
    wait_for_ready,
    wait_until,
)
from tgapi.kube_view.ready import (
    AttachTarget,
    ReadyGroup,
    TrainerGroupFailed,
    TrainerGroupForbidden,
    TrainerGroupNotFound,
    TrainerGroupNotReady,
    attach_target,
    is_failed,
    is_ready,
    ready_deadline,
)

__all__ = [
    "AttachTarget",
    "ReadyGroup",
    "TrainerGroupFailed",
    "TrainerGroupForbidden",
    "TrainerGroupNotFound",
    "TrainerGroupNotReady",
    "api_client",
    "attach_target",
    "default_k8s_namespace",
    "get_trainergroup",
    "is_failed",
    "is_ready",
    "read_status",
    "ready_deadline",
    "wait_for_ready",
    "wait_until",
]
