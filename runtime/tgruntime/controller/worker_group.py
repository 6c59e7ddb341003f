"""WorkerGroup: one controller-side object driving a group of worker actors.

Registered worker methods become methods of the group (``wg.init_model()``,
``wg.train_model(data)``): the arguments are dispatched over the ranks, the call runs on
all ranks (or rank 0), and the outputs are collected. Blocking calls return values;
non-blocking calls return ``ObjectRef``s / a ``DataProtoFuture`` that can be passed to
another group's method. The group holds strong references to its actor handles.

Ways to get a group: ``create`` (new workers), ``attach`` (by group name, through the
published record), ``from_worker_names`` and ``from_handles``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np
import ray

from tgruntime.controller import dispatch as dispatch_mod
from tgruntime.controller import naming, registry
from tgruntime.controller.calls import CallContext, resolve
from tgruntime.controller.class_with_init import ClassWithInitArgs, unwrap_actor_class
from tgruntime.controller.creation import launch
from tgruntime.controller.decorator import (
    CustomDispatch,
    Dispatch,
    Execute,
    MeshDispatch,
    MethodSpec,
    registered_methods,
)
from tgruntime.controller.errors import GroupNotFoundError, NamespaceMismatchError, WorkerDiedError
from tgruntime.controller.futures import DataProtoFuture
from tgruntime.controller.health import WorkerHealth, group_health
from tgruntime.controller.partition import is_dataproto, is_tensor
from tgruntime.controller.resource_pool import ResourcePool
from tgruntime.controller.teardown import TeardownReport, teardown_group


class GroupMethod:
    """A registered worker method bound to a group."""

    def __init__(self, group: WorkerGroup, name: str, spec: MethodSpec) -> None:
        self._group = group
        self.__name__ = name
        self.spec = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._group._invoke(self.__name__, self.spec, args, kwargs)

    def __repr__(self) -> str:
        mode = self.spec.dispatch_mode
        shown = mode.value if isinstance(mode, Dispatch) else type(mode).__name__
        return f"<group method {self.__name__} of {self._group.group_name!r} dispatch={shown}>"


class WorkerGroup:
    """A group of worker actors driven as one."""

    def __init__(
        self,
        *,
        group_name: str,
        ray_namespace: str,
        worker_names: Sequence[str],
        handles: Sequence[Any | None],
        methods: Mapping[str, MethodSpec],
        generation: int = 0,
        record: registry.GroupRecord | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        if len(worker_names) != len(handles):
            raise ValueError(f"{len(worker_names)} names for {len(handles)} handles")
        self._group_name = group_name
        self._ray_namespace = ray_namespace
        self._worker_names: tuple[str, ...] = tuple(worker_names)
        self._handles: list[Any | None] = list(handles)  # strong references
        self._generation = generation
        self._record = record
        self.call_timeout_s = call_timeout_s
        self._methods: dict[str, MethodSpec] = dict(methods)
        self._dispatch_info: dict[str, list[int]] = {}
        self._collect_info: dict[str, list[bool]] = {}
        self._actor_ids: tuple[str, ...] = tuple(
            h._actor_id.hex() if h is not None else "" for h in handles
        )
        self._all_ctx: dict[str, CallContext] = {}
        self._placement_groups: list[Any] = []
        reserved = set(dir(type(self)))
        for name, spec in self._methods.items():
            if name not in reserved:
                setattr(self, name, GroupMethod(self, name, spec))

    # ================================================================== construction
    @classmethod
    def _from_parts(cls, **parts: Any) -> Self:
        """An instance of ``cls`` from WorkerGroup's own fields, whatever the subclass's
        constructor takes (create/attach/from_* build through this, so a subclass with
        another constructor, like verl_compat.RayWorkerGroup, keeps them working)."""
        group = cls.__new__(cls)
        WorkerGroup.__init__(group, **parts)
        group._init_subclass_defaults()
        return group

    def _init_subclass_defaults(self) -> None:
        """Set a subclass's own attributes when built by :meth:`_from_parts` (none here)."""

    @classmethod
    def create(
        group_cls,  # ``cls`` is the worker-class argument of the public API
        *,
        group_name: str,
        ray_namespace: str,
        resource_pool: ResourcePool,
        cls: ClassWithInitArgs | type,
        name_prefix: str | None = None,
        detached: bool = True,
        generation: int = 0,
        pg_timeout_s: float = 120,
        actor_timeout_s: float = 120,
        env: dict[str, str] | None = None,
        mesh: Mapping[str, Any] | None = None,
        call_timeout_s: float | None = None,
        placement_groups: list[Any] | None = None,
    ) -> Self:
        """Place and start a new group, publish its record, return it.

        ``cls``: the worker class with its constructor arguments (a bare class is wrapped).
        ``name_prefix`` defaults to the group name. ``mesh`` (e.g. {"tp": 2, "dp": 1}) is
        published in the record. ``placement_groups``: already placed groups to use instead
        of creating them (they stay owned by whoever created them).
        """
        worker_cls = cls if isinstance(cls, ClassWithInitArgs) else ClassWithInitArgs(cls)
        launched = launch(
            group_name=group_name,
            ray_namespace=ray_namespace,
            resource_pool=resource_pool,
            cls=worker_cls,
            name_prefix=group_name if name_prefix is None else name_prefix,
            detached=detached,
            generation=generation,
            pg_timeout_s=pg_timeout_s,
            actor_timeout_s=actor_timeout_s,
            env=env,
            mesh=mesh,
            placement_groups=placement_groups,
        )
        group = group_cls._from_parts(
            group_name=group_name,
            ray_namespace=ray_namespace,
            worker_names=launched.worker_names,
            handles=launched.handles,
            methods=registered_methods(worker_cls.cls),
            generation=generation,
            record=launched.record,
            call_timeout_s=call_timeout_s,
        )
        group._placement_groups = list(launched.placement_groups)
        return group

    @classmethod
    def attach(
        cls,
        *,
        group_name: str,
        ray_namespace: str,
        timeout_s: float = 30,
        strict: bool = True,
        worker_cls: Any = None,
        call_timeout_s: float | None = None,
    ) -> Self:
        """Attach to a published group by name (one KV read plus one lookup per worker).

        Waits up to ``timeout_s`` only while the group is being created; an unknown name
        fails at once. ``strict``: a missing worker raises WorkerDiedError (else its handle
        is None, health() reports it NOT_FOUND or DEAD and calls raise when they reach it).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            record = registry.load_record(group_name=group_name, ray_namespace=ray_namespace)
            if record is not None:
                break
            creating = (
                registry.load_members(group_name=group_name, ray_namespace=ray_namespace)
                is not None
            )
            if not creating or time.monotonic() > deadline:
                _raise_not_found(group_name, ray_namespace, creating=creating, timeout_s=timeout_s)
            time.sleep(0.05)
        handles = [get_actor(name, ray_namespace) for name in record.worker_names]
        if strict:
            for rank, (name, handle) in enumerate(zip(record.worker_names, handles, strict=True)):
                if handle is None:
                    raise WorkerDiedError(
                        group_name=group_name,
                        rank=rank,
                        worker_name=name,
                        cause=f"no live actor named {name!r} in Ray namespace {ray_namespace!r}",
                    )
        methods = (
            registered_methods(unwrap_actor_class(_plain(worker_cls))[0])
            if worker_cls is not None
            else {n: MethodSpec.from_description(d) for n, d in record.methods.items()}
        )
        return cls._from_parts(
            group_name=group_name,
            ray_namespace=ray_namespace,
            worker_names=record.worker_names,
            handles=handles,
            methods=methods,
            generation=record.generation,
            record=record,
            call_timeout_s=call_timeout_s,
        )

    @classmethod
    def from_worker_names(
        cls,
        *,
        worker_names: Sequence[str],
        ray_namespace: str | None = None,
        worker_cls: Any = None,
        group_name: str | None = None,
        call_timeout_s: float | None = None,
    ) -> Self:
        """Attach to named workers (rank order = the order given).

        The methods come from ``worker_cls`` (a class, ray.remote class or
        ClassWithInitArgs) or, without it, from the record of the group those workers form.
        """
        ns = ray_namespace or ray.get_runtime_context().namespace
        handles = []
        for name in worker_names:
            handle = get_actor(name, ns)
            if handle is None:
                raise_missing_worker(name, ns, group_name)
            handles.append(handle)
        record = (
            registry.load_record(group_name=group_name, ray_namespace=ns)
            if group_name
            else registry.with_names(worker_names, ns)
        )
        methods = methods_from(worker_cls, record)
        return cls._from_parts(
            group_name=group_name or (record.group_name if record else ""),
            ray_namespace=ns,
            worker_names=worker_names,
            handles=handles,
            methods=methods,
            generation=record.generation if record else 0,
            record=record,
            call_timeout_s=call_timeout_s,
        )

    @classmethod
    def from_handles(
        cls,
        *,
        handles: Sequence[Any],
        worker_cls: Any = None,
        worker_names: Sequence[str] | None = None,
        ray_namespace: str | None = None,
        group_name: str | None = None,
        call_timeout_s: float | None = None,
    ) -> Self:
        """A group over actor handles you already hold (strong references are kept)."""
        ns = ray_namespace or ray.get_runtime_context().namespace
        names = (
            list(worker_names)
            if worker_names is not None
            else [f"rank{i}" for i in range(len(handles))]
        )
        record = (
            registry.load_record(group_name=group_name, ray_namespace=ns) if group_name else None
        )
        return cls._from_parts(
            group_name=group_name or "",
            ray_namespace=ns,
            worker_names=names,
            handles=handles,
            methods=methods_from(worker_cls, record),
            generation=record.generation if record else 0,
            record=record,
            call_timeout_s=call_timeout_s,
        )

    # ================================================================== properties
    @property
    def worker_names(self) -> list[str]:
        return list(self._worker_names)

    @property
    def world_size(self) -> int:
        return len(self._worker_names)

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def ray_namespace(self) -> str:
        return self._ray_namespace

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def record(self) -> registry.GroupRecord | None:
        return self._record

    @property
    def workers(self) -> list[Any | None]:
        """The actor handles, in rank order."""
        return list(self._handles)

    @property
    def placement_groups(self) -> list[Any]:
        """The placement groups this object created (empty for attached groups)."""
        return list(self._placement_groups)

    @property
    def method_names(self) -> list[str]:
        return sorted(self._methods)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only reached for names not bound in __init__: a clear error instead of a bare one.
        if name.startswith("_") or "_methods" not in self.__dict__:
            raise AttributeError(name)
        raise AttributeError(
            f"group {self._group_name!r} has no method {name!r}; registered: "
            f"{sorted(self._methods)}"
        )

    # ================================================================== calls
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a registered method by name (also those whose names clash with this class)."""
        spec = self._methods.get(method)
        if spec is None:
            raise AttributeError(
                f"group {self._group_name!r} has no method {method!r}; registered: "
                f"{sorted(self._methods)}"
            )
        return self._invoke(method, spec, args, kwargs)

    def _invoke(
        self, name: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        mode = spec.dispatch_mode
        if isinstance(mode, Dispatch):
            dispatch_fn, collect_fn = dispatch_mod.BUILTIN[mode]
        elif isinstance(mode, MeshDispatch):
            dispatch_fn, collect_fn = mode["dispatch_fn"], mode["collect_fn"]  # written once there
        else:
            assert isinstance(mode, CustomDispatch)
            dispatch_fn, collect_fn = mode.dispatch_fn, mode.collect_fn
        per_args, per_kwargs = dispatch_fn(self, *args, **kwargs)
        if isinstance(mode, CustomDispatch):
            per_args, per_kwargs = dispatch_mod.normalize(self, tuple(per_args), dict(per_kwargs))
        rank_zero = spec.execute_mode is Execute.RANK_ZERO or mode is Dispatch.RANK_ZERO
        ranks = [0] if rank_zero else list(range(self.world_size))
        refs = self._submit(name, ranks, per_args, per_kwargs)
        ctx = self._context(name, ranks)
        outputs: Any = resolve(refs, ctx, timeout_s=self.call_timeout_s) if spec.blocking else refs
        if rank_zero:
            return outputs[0]
        result = collect_fn(self, outputs)
        if isinstance(result, DataProtoFuture) and result.ctx is None:
            result.ctx = self._sub_context(ctx, refs, result.refs)
            result.call = (tuple(refs), ctx)  # every rank's: names a dead peer (calls.died_peer)
        return result

    def _submit(
        self,
        name: str,
        ranks: list[int],
        per_args: Sequence[Sequence[Any]],
        per_kwargs: Mapping[str, Sequence[Any]],
    ) -> list[Any]:
        shared = _put_shared(ranks, per_args, per_kwargs)
        refs = []
        for rank in ranks:
            handle = self._handles[rank]
            if handle is None:
                raise WorkerDiedError(
                    group_name=self._group_name,
                    rank=rank,
                    worker_name=self._worker_names[rank],
                    cause=(
                        "this handle is gone (the group was torn down here, or the worker was "
                        "missing when attached)"
                    ),
                    method=name,
                )
            call_args = [_swap(a[rank], shared) for a in per_args]
            call_kwargs = {k: _swap(v[rank], shared) for k, v in per_kwargs.items()}
            refs.append(getattr(handle, name).remote(*call_args, **call_kwargs))
        return refs

    def _context(self, method: str, ranks: list[int]) -> CallContext:
        if len(ranks) == self.world_size:
            ctx = self._all_ctx.get(method)
            if ctx is None:
                ctx = CallContext(
                    self._group_name, method, tuple(ranks), self._worker_names, self._actor_ids
                )
                self._all_ctx[method] = ctx
            return ctx
        return CallContext(
            self._group_name,
            method,
            tuple(ranks),
            tuple(self._worker_names[r] for r in ranks),
            tuple(self._actor_ids[r] for r in ranks),
        )

    @staticmethod
    def _sub_context(ctx: CallContext, refs: list[Any], chosen: list[Any]) -> CallContext | None:
        position = {ref: i for i, ref in enumerate(refs)}
        idx = [position.get(r) for r in chosen]
        if any(i is None for i in idx):
            return None
        return CallContext(
            ctx.group_name,
            ctx.method,
            tuple(ctx.ranks[i] for i in idx if i is not None),
            tuple(ctx.worker_names[i] for i in idx if i is not None),
            tuple(ctx.actor_ids[i] for i in idx if i is not None),
        )

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """verl's raw call: ObjectRefs from every rank (lists of world-size values are
        scattered)."""
        per_args, per_kwargs = dispatch_mod.normalize(self, args, kwargs)
        return self._submit(method, list(range(self.world_size)), per_args, per_kwargs)

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """verl's raw call on rank 0: one ObjectRef."""
        return self._submit(method, [0], [[a] for a in args], {k: [v] for k, v in kwargs.items()})[
            0
        ]

    # ================================================================== meshes
    def mesh_dispatch_info(self, mesh_name: str) -> list[int]:
        """dp rank of every rank in ``mesh_name`` (queried once from the workers, then cached)."""
        if mesh_name not in self._dispatch_info:
            refs = self._submit(
                "_query_dispatch_info",
                list(range(self.world_size)),
                [[mesh_name] * self.world_size],
                {},
            )
            self._dispatch_info[mesh_name] = [
                int(x)
                for x in resolve(
                    refs, self._context("_query_dispatch_info", list(range(self.world_size)))
                )
            ]
        return self._dispatch_info[mesh_name]

    def mesh_collect_info(self, mesh_name: str) -> list[bool]:
        """Whether each rank's output is collected in ``mesh_name``."""
        if mesh_name not in self._collect_info:
            refs = self._submit(
                "_query_collect_info",
                list(range(self.world_size)),
                [[mesh_name] * self.world_size],
                {},
            )
            self._collect_info[mesh_name] = [
                bool(x)
                for x in resolve(
                    refs, self._context("_query_collect_info", list(range(self.world_size)))
                )
            ]
        return self._collect_info[mesh_name]

    def _query_dispatch_info(self, mesh_name: str) -> list[int]:  # verl's name
        return self.mesh_dispatch_info(mesh_name)

    def _query_collect_info(self, mesh_name: str) -> list[bool]:  # verl's name
        return self.mesh_collect_info(mesh_name)

    # ================================================================== lifecycle
    def health(self, timeout_s: float = 10) -> list[WorkerHealth]:
        """Each worker's state (ALIVE / DEAD with cause / UNREACHABLE); never raises for a
        dead one."""
        return group_health(
            ray_namespace=self._ray_namespace,
            worker_names=self._worker_names,
            actor_ids=[a or None for a in self._actor_ids],
            handles=self._handles,
            timeout_s=timeout_s,
        )

    def teardown(self, timeout_s: float = 30) -> TeardownReport:
        """Kill the workers, remove the placement groups and the record."""
        if self._group_name:
            report = teardown_group(
                group_name=self._group_name,
                ray_namespace=self._ray_namespace,
                timeout_s=timeout_s,
                extra_worker_names=[
                    n
                    for n, h in zip(self._worker_names, self._handles, strict=True)
                    if h is not None
                ],
            )
        else:
            killed = []
            for name, handle in zip(self._worker_names, self._handles, strict=True):
                if handle is not None:
                    ray.kill(handle, no_restart=True)
                    killed.append(name)
            report = TeardownReport("", self._ray_namespace, tuple(killed), (), (), True)
        self._handles = [None] * len(self._handles)
        return report

    def __repr__(self) -> str:
        return (
            f"WorkerGroup(group_name={self._group_name!r}, ray_namespace={self._ray_namespace!r}, "
            f"world_size={self.world_size}, generation={self._generation})"
        )


# ====================================================================== helpers
def _plain(worker_cls: Any) -> Any:
    return worker_cls.cls if isinstance(worker_cls, ClassWithInitArgs) else worker_cls


def methods_from(worker_cls: Any, record: registry.GroupRecord | None) -> dict[str, MethodSpec]:
    """The registered methods: from the worker class if given, else from the group record."""
    if worker_cls is not None:
        return registered_methods(unwrap_actor_class(_plain(worker_cls))[0])
    if record is not None:
        return {n: MethodSpec.from_description(d) for n, d in record.methods.items()}
    raise TypeError("pass worker_cls=<the worker class>: no group record describes these workers")


def get_actor(name: str, ray_namespace: str) -> Any | None:
    """The named actor's handle in ``ray_namespace``, or None when there is none."""
    try:
        return ray.get_actor(name, namespace=ray_namespace)
    except ValueError:
        return None


def _raise_not_found(
    group_name: str, ray_namespace: str, *, creating: bool, timeout_s: float
) -> None:
    if creating:
        raise GroupNotFoundError(
            group_name=group_name,
            ray_namespace=ray_namespace,
            existing=registry.groups_in(ray_namespace),
            detail=f"still being created after {timeout_s:g}s",
        )
    elsewhere = [ns for ns in registry.namespaces_with_group(group_name) if ns != ray_namespace]
    if elsewhere:
        raise NamespaceMismatchError(
            group_name=group_name, ray_namespace=ray_namespace, found_in=elsewhere
        )
    raise GroupNotFoundError(
        group_name=group_name,
        ray_namespace=ray_namespace,
        existing=registry.groups_in(ray_namespace),
    )


def raise_missing_worker(name: str, ray_namespace: str, group_name: str | None) -> None:
    """Raise the WorkerDiedError / lookup error that names a missing worker and what exists."""
    label = group_name or name
    try:
        everywhere = ray.util.list_named_actors(all_namespaces=True)
    except Exception:
        everywhere = []
    found_in = sorted(
        {a["namespace"] for a in everywhere if isinstance(a, dict) and a.get("name") == name}
    )
    if found_in:
        raise NamespaceMismatchError(
            group_name=label,
            ray_namespace=ray_namespace,
            found_in=found_in,
            detail=f"worker {name!r}",
        )
    stem = naming.parse_worker_name(name)[0] if "_" in name and ":" in name else name
    similar = sorted(
        a["name"]
        for a in everywhere
        if isinstance(a, dict)
        and a.get("namespace") == ray_namespace
        and str(a.get("name", "")).startswith(stem[:8])
    )
    raise GroupNotFoundError(
        group_name=label,
        ray_namespace=ray_namespace,
        existing=registry.groups_in(ray_namespace),
        detail=f"no live actor named {name!r}"
        + (f"; similar names: {similar[:10]}" if similar else ""),
    )


def _put_shared(
    ranks: list[int], per_args: Sequence[Sequence[Any]], per_kwargs: Mapping[str, Sequence[Any]]
) -> dict[int, Any]:
    """ray.put once every large object that goes to several ranks (DataProto, arrays)."""
    if len(ranks) < 2:
        return {}
    counts: dict[int, int] = {}
    objects: dict[int, Any] = {}
    for seq in (*per_args, *per_kwargs.values()):
        for rank in ranks:
            value = seq[rank]
            if isinstance(value, np.ndarray) or is_dataproto(value) or is_tensor(value):
                counts[id(value)] = counts.get(id(value), 0) + 1
                objects[id(value)] = value
    return {i: ray.put(objects[i]) for i, c in counts.items() if c > 1}


def _swap(value: Any, shared: dict[int, Any]) -> Any:
    return shared.get(id(value), value) if shared else value
