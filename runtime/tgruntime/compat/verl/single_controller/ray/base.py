"""verl's ``verl.single_controller.ray`` (``ray/base.py``): RayResourcePool, RayClassWithInitArgs,
RayWorkerGroup, over :mod:`tgruntime.controller`. The differences from verl are listed in
:mod:`tgruntime.compat.verl`."""


from __future__ import annotations

import errno
import logging
import re
import secrets
import socket
import string
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from tgruntime.controller.class_with_init import ClassWithInitArgs
from tgruntime.controller.creation import launch
from tgruntime.controller.decorator import (
    registered_methods,
)
from tgruntime.controller.resource_pool import ResourcePool, create_placement_groups
from tgruntime.controller.worker_group import (
    WorkerGroup,
    get_actor,
    methods_from,
    raise_missing_worker,
)

log = logging.getLogger("tgruntime.compat.verl")


# ---------------------------------------------------------------------------- workers
#: What RayWorkerGroup sets in each worker's environment; ``worker_env`` may not override it.
#: verl protects RANK, WORLD_SIZE, WG_PREFIX, WG_BACKEND, RAY_LOCAL_WORLD_SIZE and
#: MASTER_ADDR/PORT; the rest are tgruntime's own (ranks, group identity).
PROTECTED_ENV = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "WG_PREFIX",
        "WG_BACKEND",
        "RAY_LOCAL_WORLD_SIZE",
        "RAY_LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    }
)

#: verl's RayWorkerGroup keyword arguments that only affect profiling: accepted, ignored.
_IGNORED_KWARGS = ("profile_steps", "worker_nsight_options")


class RayResourcePool:
    """verl's RayResourcePool: processes per node, GPU or CPU bundles, optional detached PGs."""

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str = "",
        max_colocate_count: int = 10,
        detached: bool = False,
        accelerator_type: str | None = None,
    ) -> None:
        self._store = [int(c) for c in (process_on_nodes or [])]
        if not self._store:
            raise ValueError("process_on_nodes must list the processes per node, e.g. [2]")
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix
        self.max_colocate_count = max(1, int(max_colocate_count))
        self.detached = detached
        self.accelerator_type = accelerator_type
        self.pgs: list[PlacementGroup] | None = None

    @property
    def store(self) -> list[int]:
        return list(self._store)

    @property
    def world_size(self) -> int:
        return sum(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def local_world_size_list(self) -> list[int]:
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        return [i for n in self._store for i in range(n)]

    def to_resource_pool(self, strategy: str = "STRICT_PACK") -> ResourcePool:
        """Our ResourcePool with bundles that this cluster can actually place."""
        bundle_cpus = _bundle_cpus(self.max_colocate_count, max(self._store))
        return ResourcePool(
            process_on_nodes=self._store,
            use_gpu=self.use_gpu,
            gpus_per_process=1.0,
            cpus_per_process=bundle_cpus,
            strategy=strategy,
            detached=self.detached,
            resources_per_process={f"accelerator_type:{self.accelerator_type}": 0.001}
            if self.accelerator_type
            else {},
            actor_num_cpus=bundle_cpus / self.max_colocate_count,
            actor_num_gpus=(1.0 / self.max_colocate_count) if self.use_gpu else 0.0,
        )

    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, timeout_s: float = 300
    ) -> list[PlacementGroup]:
        """Create (once) and return the pool's placement groups; bounded wait."""
        if self.pgs is None:
            group = _safe_name(
                name or f"{self.name_prefix}verl_group_{'_'.join(map(str, self._store))}"
            )
            self.pgs = create_placement_groups(
                self.to_resource_pool(strategy),
                group_name=group,
                ray_namespace=_ray_namespace(),
                generation=0,
                detached=self.detached,
                timeout_s=timeout_s,
            )
        return list(self.pgs)


class RayClassWithInitArgs(ClassWithInitArgs):
    """verl's RayClassWithInitArgs: the worker class (plain or ``@ray.remote``) and its
    arguments."""

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(cls, *args, **kwargs)
        self._additional_resource: dict[str, float] = {}
        self.fused_worker_used = False

    def set_additional_resource(self, additional_resource: dict[str, float]) -> None:
        self._additional_resource = dict(additional_resource)
        self.update_options({"resources": dict(additional_resource)})


class RayWorkerGroup(WorkerGroup):
    """verl's RayWorkerGroup: create workers from a pool, or attach to detached ones."""

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: RayClassWithInitArgs | ClassWithInitArgs | None = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[Any] | None = None,
        ray_wait_register_center_timeout: int = 300,
        *,
        worker_env: Mapping[str, str] | None = None,
        master_addr: str | None = None,
        master_port: int | str | None = None,
        master_port_range: Sequence[int] | None = None,
        use_gpu: bool | None = None,
        device_name: str = "cuda",
        **kwargs: Any,
    ) -> None:
        unknown = sorted(k for k in kwargs if k not in _IGNORED_KWARGS)
        if unknown:
            raise TypeError(
                "RayWorkerGroup() got unexpected keyword argument(s): "
                f"{', '.join(map(repr, unknown))}"
            )
        for key in _IGNORED_KWARGS:
            if kwargs.get(key) is not None:
                log.warning("RayWorkerGroup: %s is not supported here and is ignored", key)
        env = _worker_env(worker_env, master_addr, master_port)
        port_range = _port_range(master_port_range)
        self._ray_master_port_range = list(port_range) if port_range is not None else None
        self.customized_worker_env = dict(worker_env or {})
        self.device_name = device_name
        self.use_gpu = (
            use_gpu if use_gpu is not None else (resource_pool.use_gpu if resource_pool else True)
        )
        if resource_pool is not None and self.use_gpu and not resource_pool.use_gpu:
            raise ValueError("use_gpu is True but resource_pool.use_gpu is False")
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = _random_prefix() if name_prefix is None else name_prefix
        self.fused_worker_used = False
        self.sub_cls_name = ""
        ray_namespace = _ray_namespace()
        if worker_names is not None or worker_handles is not None:
            self._init_detached(ray_namespace, worker_names, worker_handles)
            return
        if resource_pool is None or ray_cls_with_init is None:
            raise TypeError(
                "RayWorkerGroup needs resource_pool and ray_cls_with_init (or worker_names to "
                "attach)"
            )
        cia = ray_cls_with_init
        group_name = _safe_name(f"{self.name_prefix}{cia.class_name}")
        strategy = "STRICT_PACK" if bin_pack else "PACK"
        # The first group on a pool names its placement groups (so teardown_group(group) finds
        # them); later groups on the same pool share them, as verl's colocated roles do.
        pgs = resource_pool.get_placement_groups(
            strategy=strategy, name=group_name, timeout_s=ray_wait_register_center_timeout
        )
        if port_range is not None and "MASTER_ADDR" not in env:
            # verl's rule: an explicit master_addr/master_port wins over the range
            addr, port = master_in_range(pgs[0], port_range)
            env["MASTER_ADDR"], env["MASTER_PORT"] = addr, str(port)
        launched = launch(
            group_name=group_name,
            ray_namespace=ray_namespace,
            resource_pool=resource_pool.to_resource_pool(strategy),
            cls=cia,
            name_prefix=self.name_prefix,
            detached=detached,
            generation=0,
            pg_timeout_s=ray_wait_register_center_timeout,
            actor_timeout_s=ray_wait_register_center_timeout,
            env=env,
            mesh=None,
            placement_groups=pgs,
        )
        super().__init__(
            group_name=group_name,
            ray_namespace=ray_namespace,
            worker_names=launched.worker_names,
            handles=launched.handles,
            methods=registered_methods(cia.cls),
            record=launched.record,
        )

    def _init_detached(
        self,
        ray_namespace: str,
        worker_names: Sequence[str] | None,
        worker_handles: Sequence[Any] | None,
    ) -> None:
        if worker_handles is not None:
            handles = list(worker_handles)
            names = (
                list(worker_names)
                if worker_names is not None
                else [f"rank{i}" for i in range(len(handles))]
            )
        else:
            assert worker_names is not None
            names = list(worker_names)
            handles = []
            for name in names:
                handle = get_actor(name, ray_namespace)
                if handle is None:
                    raise_missing_worker(name, ray_namespace, None)
                handles.append(handle)
        from tgruntime.controller import registry

        record = registry.with_names(names, ray_namespace) if worker_names is not None else None
        super().__init__(
            group_name=record.group_name if record else "",
            ray_namespace=ray_namespace,
            worker_names=names,
            handles=handles,
            methods=methods_from(self.ray_cls_with_init, record),
            generation=record.generation if record else 0,
            record=record,
        )

    @classmethod
    def from_detached(
        cls,
        name_prefix: str | None = None,
        worker_names: Sequence[str] | None = None,
        worker_handles: Sequence[Any] | None = None,
        ray_cls_with_init: RayClassWithInitArgs | ClassWithInitArgs | None = None,
    ) -> RayWorkerGroup:
        """Attach to running (detached) workers by name or handle."""
        return cls(
            resource_pool=None,
            ray_cls_with_init=ray_cls_with_init,
            name_prefix=name_prefix,
            worker_names=worker_names,
            worker_handles=worker_handles,
        )

    def _init_subclass_defaults(self) -> None:
        """verl's attributes for a group built by WorkerGroup's create/attach/from_*."""
        self.customized_worker_env = {}
        self.device_name = "cuda"
        self.use_gpu = bool(self.record.use_gpu) if self.record is not None else True
        self.ray_cls_with_init = None
        self.name_prefix = ""
        self.fused_worker_used = False
        self.sub_cls_name = ""

    # verl's attribute names
    @property
    def _workers(self) -> list[Any]:
        return self.workers

    def execute_all_sync(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return list(ray.get(self.execute_all(method_name, *args, **kwargs)))

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.execute_all(method_name, *args, **kwargs)

    def execute_rank_zero_sync(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.execute_rank_zero(method_name, *args, **kwargs))

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        return self.execute_rank_zero(method_name, *args, **kwargs)


# ---------------------------------------------------------------------------- helpers
def _worker_env(
    worker_env: Mapping[str, str] | None, master_addr: str | None, master_port: int | str | None
) -> dict[str, str]:
    """The extra environment for every worker: ``worker_env`` plus a given master address."""
    env = {str(k): str(v) for k, v in (worker_env or {}).items()}
    conflicts = sorted(k for k in env if k in PROTECTED_ENV or k.startswith("TG_"))
    if conflicts:
        raise ValueError(f"Cannot override protected system env: {', '.join(conflicts)}")
    if (master_addr is None) != (master_port is None):
        raise ValueError("give both master_addr and master_port, or neither")
    if master_addr is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = str(master_addr), str(master_port)
    return env


def _port_range(value: Sequence[int] | None) -> tuple[int, int] | None:
    """verl's ``master_port_range``: ``[low, high]``, ports ``low`` .. ``high - 1`` tried."""
    if value is None:
        return None
    try:
        low, high = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"master_port_range must be [low, high] (two port numbers), not {value!r}"
        ) from None
    if not 1 <= low < high <= 65536:
        raise ValueError(
            f"master_port_range {[low, high]}: need 1 <= low < high <= 65536 (ports low .. "
            "high-1 are tried)"
        )
    return low, high


def first_free_port(low: int, high: int, host: str = "") -> int:
    """The first port in ``low`` .. ``high - 1`` that no socket of this node holds.

    A plain ``bind`` (without SO_REUSEADDR) fails on a port that any socket is bound to,
    listening or not, so ports held by another group's rank 0 (``tgruntime.controller.worker``
    keeps its reservation bound) are skipped as well as listening ones.
    """
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise
            return port
    raise RuntimeError(
        f"no free port in master_port_range [{low}, {high}] on this node "
        f"({high - low} tried): widen the range or free a port"
    )


@ray.remote(num_cpus=0)
def _pick_master(low: int, high: int) -> tuple[str, int]:
    addr = str(ray.util.get_node_ip_address()).strip("[]")  # type: ignore[no-untyped-call]
    return addr, first_free_port(low, high)


def master_in_range(pg: PlacementGroup, port_range: tuple[int, int]) -> tuple[str, int]:
    """MASTER_ADDR and a MASTER_PORT inside ``port_range``, chosen on rank 0's node (bundle 0
    of the first placement group), as verl does before creating the workers."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0
    )
    ref = _pick_master.options(scheduling_strategy=strategy).remote(*port_range)
    addr, port = ray.get(ref, timeout=120)
    return str(addr), int(port)


def _ray_namespace() -> str:
    if not ray.is_initialized():
        raise RuntimeError(
            "call ray.init(namespace=...) (or tgruntime.controller.connect.connect) first"
        )
    return str(ray.get_runtime_context().namespace)


def _random_prefix() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(6))


def _safe_name(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._") or "group"
    return cleaned[:128]


def _bundle_cpus(max_colocate_count: int, processes: int) -> float:
    """verl's CPUs per bundle, reduced to what the largest node can hold for ``processes``."""
    try:
        largest = max(
            (float(n.get("Resources", {}).get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")),  # type: ignore[no-untyped-call]
            default=0.0,
        )
    except Exception:
        largest = 0.0
    if largest <= 0:
        return float(max_colocate_count)
    fit = largest / processes
    if fit >= max_colocate_count:
        return float(max_colocate_count)
    log.warning(
        "verl's bundles of max_colocate_count=%d CPUs cannot be placed here (largest node: %g CPUs "
        "for %d "
        "processes); using %.3g CPUs per bundle",
        max_colocate_count,
        largest,
        processes,
        fit,
    )
    return round(fit, 3)
