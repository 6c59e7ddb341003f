"""The single-controller layer: workers, groups, dispatch, DataProto, records, teardown.

verl's ``single_controller`` pattern as a library: a controller process creates (or
attaches to) a group of Ray actors and calls their registered methods as one; groups
can be detached, published by name, checked for health and torn down from anywhere.
See docs/runtime-core.md.

Names are imported lazily (PEP 562): a worker module that needs only ``Worker`` and
``register`` does not import torch when its actor starts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tgruntime.controller.calls import CallContext
    from tgruntime.controller.class_with_init import ClassWithInitArgs
    from tgruntime.controller.dataproto import DataProto, DataProtoItem
    from tgruntime.controller.decorator import (
        CustomDispatch,
        Dispatch,
        Execute,
        MeshDispatch,
        MethodSpec,
        make_nd_compute_dataproto_dispatch_fn,
        register,
        registered_methods,
    )
    from tgruntime.controller.errors import (
        ActorStartTimeoutError,
        CallTimeoutError,
        GroupExistsError,
        GroupNotFoundError,
        NamespaceMismatchError,
        PlacementInfeasibleError,
        PlacementTimeoutError,
        RayConnectError,
        TrainerGroupError,
        WorkerDiedError,
        WorkerMethodError,
        WorkerStartError,
    )
    from tgruntime.controller.futures import DataProtoFuture
    from tgruntime.controller.health import WorkerHealth
    from tgruntime.controller.registry import GroupRecord, list_groups, load_record
    from tgruntime.controller.resource_pool import PlacementStrategy, ResourcePool
    from tgruntime.controller.teardown import TeardownReport, teardown_group
    from tgruntime.controller.worker import Worker
    from tgruntime.controller.worker_group import WorkerGroup

_LAZY: dict[str, str] = {
    "ActorStartTimeoutError": "errors",
    "CallContext": "calls",
    "CallTimeoutError": "errors",
    "ClassWithInitArgs": "class_with_init",
    "CustomDispatch": "decorator",
    "DataProto": "dataproto",
    "DataProtoFuture": "futures",
    "DataProtoItem": "dataproto",
    "Dispatch": "decorator",
    "Execute": "decorator",
    "GroupExistsError": "errors",
    "GroupNotFoundError": "errors",
    "GroupRecord": "registry",
    "MeshDispatch": "decorator",
    "MethodSpec": "decorator",
    "NamespaceMismatchError": "errors",
    "PlacementInfeasibleError": "errors",
    "PlacementStrategy": "resource_pool",
    "PlacementTimeoutError": "errors",
    "RayConnectError": "errors",
    "ResourcePool": "resource_pool",
    "TeardownReport": "teardown",
    "TrainerGroupError": "errors",
    "Worker": "worker",
    "WorkerDiedError": "errors",
    "WorkerGroup": "worker_group",
    "WorkerHealth": "health",
    "WorkerMethodError": "errors",
    "WorkerStartError": "errors",
    "list_groups": "registry",
    "load_record": "registry",
    "make_nd_compute_dataproto_dispatch_fn": "decorator",
    "register": "decorator",
    "registered_methods": "decorator",
    "teardown_group": "teardown",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tgruntime.controller' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tgruntime.controller.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ActorStartTimeoutError",
    "CallContext",
    "CallTimeoutError",
    "ClassWithInitArgs",
    "CustomDispatch",
    "DataProto",
    "DataProtoFuture",
    "DataProtoItem",
    "Dispatch",
    "Execute",
    "GroupExistsError",
    "GroupNotFoundError",
    "GroupRecord",
    "MeshDispatch",
    "MethodSpec",
    "NamespaceMismatchError",
    "PlacementInfeasibleError",
    "PlacementStrategy",
    "PlacementTimeoutError",
    "RayConnectError",
    "ResourcePool",
    "TeardownReport",
    "TrainerGroupError",
    "Worker",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerHealth",
    "WorkerMethodError",
    "WorkerStartError",
    "list_groups",
    "load_record",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "registered_methods",
    "teardown_group",
]
