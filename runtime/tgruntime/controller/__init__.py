"""The single-controller layer: workers, groups, dispatch, DataProto, records, teardown.

verl's ``single_controller`` pattern as a library: a controller process creates (or
attaches to) a group of Ray actors and calls their registered methods as one; groups
can be detached, published by name, checked for health and torn down from anywhere.
See docs/runtime-core.md.
"""

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
