"""Creating a group's workers: claim the name, place, start the actors, wait, publish.

Steps, each bounded in time, and on any failure everything created so far is removed
(nothing half-created is left behind):

1. check-before-create: a live group of that name is an error; leftovers of a crashed
   creation (keys, no live actors or placement groups) are cleaned;
2. claim the ``members`` key atomically (a concurrent creator loses);
3. create the placement groups and wait (PlacementTimeoutError);
4. start every rank at once; rank 0 publishes the master port, others wait for it;
5. wait for every actor's constructor (ActorStartTimeoutError / WorkerStartError);
6. publish the group record.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tgruntime.controller import naming, registry
from tgruntime.controller.calls import actor_error_cause, mark_retrieved
from tgruntime.controller.class_with_init import ClassWithInitArgs
from tgruntime.controller.decorator import registered_methods
from tgruntime.controller.errors import ActorStartTimeoutError, GroupExistsError, WorkerStartError
from tgruntime.controller.resource_pool import (
    ResourcePool,
    create_placement_groups,
    find_placement_groups,
)
from tgruntime.controller.teardown import teardown_group
from tgruntime.controller.worker import (
    ENV_GENERATION,
    ENV_GROUP,
    ENV_MASTER_TIMEOUT,
    ENV_NAMESPACE,
    ENV_WORKER_NAME,
)


@dataclass(frozen=True)
class Launched:
    """A started group: names and handles in rank order, and its published record."""

    worker_names: tuple[str, ...]
    handles: tuple[Any, ...]
    record: registry.GroupRecord
    placement_groups: tuple[PlacementGroup, ...]


def launch(
    *,
    group_name: str,
    ray_namespace: str,
    resource_pool: ResourcePool,
    cls: ClassWithInitArgs,
    name_prefix: str,
    detached: bool,
    generation: int,
    pg_timeout_s: float,
    actor_timeout_s: float,
    env: Mapping[str, str] | None,
    mesh: Mapping[str, Any] | None,
    placement_groups: list[PlacementGroup] | None = None,
) -> Launched:
    naming.validate_group_name(group_name)
    naming.validate_namespace(ray_namespace)
    _check_before_create(group_name=group_name, ray_namespace=ray_namespace)

    class_name = cls.class_name
    counts = resource_pool.process_on_nodes
    names = [
        naming.worker_name(prefix=name_prefix, class_name=class_name, pg_index=pg, local_rank=local)
        for pg, count in enumerate(counts)
        for local in range(count)
    ]
    claimed = registry.claim_members(
        group_name=group_name,
        ray_namespace=ray_namespace,
        members=registry.Members(tuple(names), generation),
    )
    if not claimed:
        raise GroupExistsError(
            group_name=group_name, ray_namespace=ray_namespace, generation=generation
        )

    handles: list[Any] = []
    try:
        owned = placement_groups is None
        pgs = (
            placement_groups
            if placement_groups is not None
            else create_placement_groups(
                resource_pool,
                group_name=group_name,
                ray_namespace=ray_namespace,
                generation=generation,
                detached=detached,
                timeout_s=pg_timeout_s,
            )
        )
        if len(pgs) != len(counts):
            raise ValueError(f"{len(pgs)} placement groups given for {len(counts)} nodes")
        for i, (pg, count) in enumerate(zip(pgs, counts, strict=True)):
            if pg.bundle_count < count:
                raise ValueError(
                    f"placement group {i} has {pg.bundle_count} bundles for {count} processes "
                    f"(process_on_nodes={list(counts)})"
                )
        remote_cls = cls.remote_class()
        world_size = resource_pool.world_size
        rank = 0
        for pg, count in zip(pgs, counts, strict=True):
            for local_rank in range(count):
                name = names[rank]
                options = _actor_options(
                    cls=cls,
                    pool=resource_pool,
                    pg=pg,
                    bundle_index=local_rank,
                    name=name,
                    ray_namespace=ray_namespace,
                    detached=detached,
                    env={
                        "RANK": str(rank),
                        "WORLD_SIZE": str(world_size),
                        "LOCAL_RANK": str(local_rank),
                        "LOCAL_WORLD_SIZE": str(count),
                        ENV_GROUP: group_name,
                        ENV_NAMESPACE: ray_namespace,
                        ENV_GENERATION: str(generation),
                        ENV_WORKER_NAME: name,
                        ENV_MASTER_TIMEOUT: str(actor_timeout_s),
                        "WG_PREFIX": name_prefix,
                        "WG_BACKEND": "ray",
                        **dict(env or {}),
                    },
                )
                handles.append(remote_cls.options(**options).remote(*cls.args, **cls.kwargs))
                rank += 1
        _wait_ready(group_name=group_name, names=names, handles=handles, timeout_s=actor_timeout_s)
        pg_names = (
            tuple(
                naming.placement_group_name(
                    ray_namespace=ray_namespace,
                    group_name=group_name,
                    generation=generation,
                    index=i,
                )
                for i in range(len(pgs))
            )
            if owned
            else ()
        )
        record = registry.GroupRecord(
            group_name=group_name,
            ray_namespace=ray_namespace,
            worker_names=tuple(names),
            world_size=world_size,
            mesh=dict(mesh or {}),
            worker_class=cls.import_path,
            generation=generation,
            created_at=time.time(),
            methods={n: spec.describe() for n, spec in registered_methods(cls.cls).items()},
            placement_groups=pg_names,
            use_gpu=resource_pool.use_gpu,
        )
        registry.publish_record(record)
    except BaseException:
        teardown_group(
            group_name=group_name,
            ray_namespace=ray_namespace,
            timeout_s=30,
            extra_worker_names=names,
        )
        raise
    return Launched(
        worker_names=tuple(names),
        handles=tuple(handles),
        record=record,
        placement_groups=tuple(pgs),
    )


def _actor_options(
    *,
    cls: ClassWithInitArgs,
    pool: ResourcePool,
    pg: PlacementGroup,
    bundle_index: int,
    name: str,
    ray_namespace: str,
    detached: bool,
    env: dict[str, str],
) -> dict[str, Any]:
    options: dict[str, Any] = {**cls.remote_defaults, **pool.actor_options(), **cls.options}
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**dict(runtime_env.get("env_vars") or {}), **env}
    options.update(
        name=name,
        namespace=ray_namespace,  # Ray's actor option
        runtime_env=runtime_env,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index
        ),
    )
    if detached:
        options["lifetime"] = "detached"
    else:
        options.pop("lifetime", None)
    return options


def _wait_ready(*, group_name: str, names: list[str], handles: list[Any], timeout_s: float) -> None:
    refs = [h.__ray_ready__.remote() for h in handles]
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            mark_retrieved(pending)  # a constructor failing later is not an "Unhandled error"
            raise ActorStartTimeoutError(
                group_name=group_name,
                timeout_s=timeout_s,
                pending=[f"rank {index[r]} ({names[index[r]]})" for r in pending],
            )
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as exc:
                cause = _start_cause(exc) if isinstance(exc, RayActorError) else str(exc)
                mark_retrieved(refs)  # the other ranks' errors are not "Unhandled errors"
                raise WorkerStartError(
                    group_name=group_name,
                    rank=index[ref],
                    worker_name=names[index[ref]],
                    cause=cause,
                ) from exc


def _start_cause(exc: RayActorError) -> str:
    text = str(exc)
    if "creation task" in text:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        # keep the user's exception (the last line of the remote traceback) and its location
        return " | ".join(lines[-3:]) if len(lines) > 3 else text
    return actor_error_cause(exc)


def _check_before_create(*, group_name: str, ray_namespace: str) -> None:
    """A live group of that name is an error; leftovers without live parts are cleaned."""
    record = registry.load_record(group_name=group_name, ray_namespace=ray_namespace)
    members = registry.load_members(group_name=group_name, ray_namespace=ray_namespace)
    if record is None and members is None:
        return
    names = set(record.worker_names if record else ()) | set(
        members.worker_names if members else ()
    )
    live = [n for n in names if _alive(n, ray_namespace)]
    pgs = find_placement_groups(ray_namespace=ray_namespace, group_name=group_name)
    if live or pgs:
        generation = record.generation if record else (members.generation if members else 0)
        raise GroupExistsError(
            group_name=group_name, ray_namespace=ray_namespace, generation=generation
        )
    registry.delete_group_keys(group_name=group_name, ray_namespace=ray_namespace)


def _alive(name: str, ray_namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=ray_namespace)
        return True
    except ValueError:
        return False
