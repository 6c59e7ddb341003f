"""Kueue: a TrainerGroup with ``spec.queue`` waits for admission before its RayCluster starts.

Kueue's RayCluster integration admits a RayCluster as one Workload (head and workers
together: all or nothing). The operator's part:

* :func:`labels` and :func:`add_to_cluster`: the RayCluster is created with
  ``spec.suspend: true`` and the labels ``kueue.x-k8s.io/queue-name`` (and
  ``kueue.x-k8s.io/priority-class``). From then on Kueue owns ``spec.suspend``: the operator
  never patches it (it never updates a RayCluster's spec at all, see decide.py), never
  deletes a queued cluster for being slow (no cluster timeout while Queued), and reads a
  suspended cluster as waiting, not as a failure.
* :func:`suspended`: the cluster waits for Kueue (its spec says suspend, as Kueue leaves it
  until admission, and again after a preemption).
* :func:`workload_of` / :func:`admission_message`: the Workload Kueue made for the cluster (it
  carries the label ``kueue.x-k8s.io/job-uid`` = the RayCluster's uid) and why it is not
  admitted yet, for ``status.message``.
* ``priority_class_exists`` (read by reconcile.observe only while a suspended cluster has no
  Workload and the group names a priority class): Kueue makes no Workload, and posts no event,
  for a RayCluster whose ``kueue.x-k8s.io/priority-class`` names a WorkloadPriorityClass that
  does not exist; :func:`admission_message` then says so, with the fix. The phase stays Queued
  (the class may be created later, and Kueue then admits the cluster).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tgapi import TrainerGroup

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
WORKLOAD_GROUP = "kueue.x-k8s.io"
WORKLOAD_VERSION = "v1beta2"
WORKLOAD_PLURAL = "workloads"
PRIORITY_CLASS_PLURAL = "workloadpriorityclasses"
"""Kueue's WorkloadPriorityClass: cluster-scoped, same group and version as the Workload."""


def labels(tg: TrainerGroup) -> dict[str, str]:
    """The Kueue labels of the group's RayCluster (none without ``spec.queue``)."""
    q = tg.spec.queue
    if q is None:
        return {}
    out = {QUEUE_LABEL: q.name}
    if q.priority_class:
        out[PRIORITY_LABEL] = q.priority_class
    return out


def add_to_cluster(manifest: dict[str, Any], tg: TrainerGroup) -> None:
    """Create the RayCluster suspended and labelled for its queue (no-op without one)."""
    if tg.spec.queue is None:
        return
    manifest["metadata"].setdefault("labels", {}).update(labels(tg))
    manifest["spec"]["suspend"] = True


def suspended(raycluster: Mapping[str, Any]) -> bool:
    """The RayCluster waits for Kueue: suspended in its spec (or KubeRay says so)."""
    if raycluster.get("spec", {}).get("suspend"):
        return True
    return str(raycluster.get("status", {}).get("state") or "") == "suspended"


def workload_of(
    workloads: Sequence[Mapping[str, Any]], *, cluster_uid: str
) -> Mapping[str, Any] | None:
    """The Workload Kueue made for the RayCluster with ``cluster_uid`` (None: not yet)."""
    for w in workloads:
        if (w.get("metadata", {}).get("labels") or {}).get(JOB_UID_LABEL) == cluster_uid:
            return w
    return None


def admission_message(
    workload: Mapping[str, Any] | None,
    *,
    queue: str,
    priority_class: str | None = None,
    priority_class_exists: bool | None = None,
) -> str:
    """Why the cluster waits, in Kueue's words where the Workload gives them.

    With no Workload, ``priority_class_exists`` False (the group's ``priority_class`` is known
    to be missing) names that as the reason: Kueue makes no Workload for such a cluster and says
    so only in its own log. None (not read, no Kueue, no RBAC) or True: no Workload yet.
    """
    if workload is None:
        if priority_class and priority_class_exists is False:
            return (
                f"waiting for Kueue: WorkloadPriorityClass {priority_class} does not exist, so "
                f"Kueue makes no Workload for this RayCluster (LocalQueue {queue}); create the "
                "WorkloadPriorityClass or change spec.queue.priorityClass"
            )
        return f"waiting for Kueue to admit the RayCluster (LocalQueue {queue}; no Workload yet)"
    name = str(workload.get("metadata", {}).get("name") or "")
    conds = {
        str(c.get("type")): c
        for c in workload.get("status", {}).get("conditions") or []
        if isinstance(c, Mapping)
    }
    why = ""
    for ctype in ("Evicted", "Preempted", "QuotaReserved", "Admitted"):
        c = conds.get(ctype)
        if c is None:
            continue
        wanted = "True" if ctype in ("Evicted", "Preempted") else "False"
        if c.get("status") == wanted and c.get("message"):
            why = str(c["message"])
            break
    text = f"waiting in Kueue LocalQueue {queue} (Workload {name})"
    return f"{text}: {why}" if why else text
