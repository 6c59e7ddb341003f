"""The side effects of a group's creation: read the cluster, import the worker class, place and
start the detached group of a :class:`~tgruntime.launch.plan.GroupPlan` (no ``init_model``)."""

from __future__ import annotations

import importlib

from tgruntime.controller import ClassWithInitArgs, WorkerGroup
from tgruntime.controller.resource_pool import check_feasible, cluster_nodes_resources
from tgruntime.launch.plan import ClusterResources, GroupPlan


def cluster_resources() -> ClusterResources:
    """The connected Ray cluster's alive nodes and their totals."""
    return ClusterResources(nodes=tuple(cluster_nodes_resources()))


def import_worker_class(path: str) -> type:
    """Import ``module:Class``; errors say which part failed and how to fix it."""
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"spec.workers.workerClass: cannot import module {module_name!r} ({exc}). "
            "Fix: install the package that provides it in the runtime image, or correct the path"
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(
            f"spec.workers.workerClass: module {module_name!r} has no class {class_name!r}. "
            "Fix: use module:Class with an existing class"
        )
    return cls


def create(p: GroupPlan) -> WorkerGroup:
    """Create the detached group of plan ``p`` (no ``init_model`` yet).

    A group the cluster's totals can never hold fails at once with PlacementInfeasibleError,
    naming what was asked, what the cluster has and what to change (``p.infeasible_fix``).
    """
    check_feasible(p.pool, group_name=p.tg.group_name, fix=p.infeasible_fix)
    cls = import_worker_class(p.tg.spec.workers.worker_class)
    timeout_s = float(p.tg.spec.timeouts.workers_ready_seconds)
    return WorkerGroup.create(
        group_name=p.tg.group_name,
        ray_namespace=p.tg.ray_namespace,
        resource_pool=p.pool,
        cls=ClassWithInitArgs(cls, p.init_payload),
        name_prefix=p.name_prefix,
        detached=True,
        generation=p.generation,
        pg_timeout_s=timeout_s,
        actor_timeout_s=timeout_s,
        mesh=dict(p.mesh),
        env=dict(p.env),
    )
