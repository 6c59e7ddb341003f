"""The plan of a group, from its spec and the cluster's resources: pure (no Ray, no I/O).

:func:`plan` computes once everything the creation needs: the spec with ``useGpu: auto``
resolved, the resource pool, the workers' environment, the parallel mesh, the worker-name
prefix of the generation, the workers' init payload (the spec as JSON) and what to change when
the cluster can never hold the group. :mod:`tgruntime.launch.create` acts on it, and
:mod:`tgruntime.launch.report` turns the workers' answers into the ready line.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import tgapi
from tgruntime.controller.resource_pool import ResourcePool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterResources:
    """What the connected cluster has: the totals of each alive node (``ray.nodes()``)."""

    nodes: tuple[Mapping[str, float], ...]

    @property
    def gpus(self) -> float:
        return float(sum(n.get("GPU", 0.0) for n in self.nodes))

    @property
    def cpus(self) -> float:
        return float(sum(n.get("CPU", 0.0) for n in self.nodes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Everything :func:`tgruntime.launch.create.create` needs, computed once."""

    tg: tgapi.TrainerGroup
    """The resource with ``workers.useGpu`` resolved (never "auto")."""
    generation: int
    pool: ResourcePool
    env: Mapping[str, str]
    mesh: Mapping[str, int]
    name_prefix: str
    init_payload: str
    """The workers' constructor argument: the resolved spec as JSON (``spec_json``)."""
    infeasible_fix: str
    gpu_auto: bool
    """True when the spec said ``useGpu: auto`` (the plan resolved it against the cluster)."""

    @property
    def use_gpu(self) -> bool:
        return _use_gpu(self.tg.spec)


def plan(
    tg: tgapi.TrainerGroup, *, generation: int, cluster: ClusterResources
) -> GroupPlan:
    """The plan for generation ``generation`` of ``tg`` on a cluster with ``cluster``."""
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation}")
    gpu_auto = tg.spec.workers.use_gpu == tgapi.USE_GPU_AUTO
    tg = resolve_gpu(tg, gpus=cluster.gpus)
    return GroupPlan(
        tg=tg,
        generation=generation,
        pool=resource_pool(tg.spec),
        env=worker_env(tg.spec),
        mesh=mesh_of(tg.spec),
        name_prefix=name_prefix(tg, generation),
        init_payload=spec_json(tg.spec),
        infeasible_fix=infeasible_fix(tg.spec, cluster.nodes),
        gpu_auto=gpu_auto,
    )


def name_prefix(tg: tgapi.TrainerGroup, generation: int) -> str:
    """Worker-name prefix: the configured prefix, plus ``-g{N}-`` after the first generation.

    Generation 0 keeps verl's exact shape (``tinyMegatronTrainer_0:1``); a re-created group
    gets new names (``tiny-g1-MegatronTrainer_0:1``) so a stale client can never reach it
    by an old name.
    """
    return tg.name_prefix if generation == 0 else f"{tg.name_prefix}-g{generation}-"


def resolve_gpu(tg: tgapi.TrainerGroup, *, gpus: float) -> tgapi.TrainerGroup:
    """``tg`` with ``workers.useGpu: auto`` resolved against the connected cluster.

    "auto" means GPU workers when the cluster has any GPU (``gpus`` > 0), else CPU workers
    (gloo). Resolved once, in :func:`plan`: the workers get the resolved spec, and the record
    and the ready line carry the result (``useGpu``).
    """
    if tg.spec.workers.use_gpu != tgapi.USE_GPU_AUTO:
        return tg
    resolved = tg.spec.with_gpu_resolved(gpus)
    return dataclasses.replace(tg, spec=resolved)


def _use_gpu(spec: tgapi.TrainerGroupSpec) -> bool:
    value = spec.workers.use_gpu
    if not isinstance(value, bool):
        raise ValueError(
            f'spec.workers.useGpu is {value!r}: resolve "auto" first (launch.plan.resolve_gpu)'
        )
    return value


def resource_pool(spec: tgapi.TrainerGroupSpec) -> ResourcePool:
    w = spec.workers
    return ResourcePool(
        process_on_nodes=list(w.processes_per_node),
        use_gpu=_use_gpu(spec),
        cpus_per_process=w.cpus_per_process,
        strategy=w.placement_strategy,
        detached=True,
    )


def spec_json(spec: tgapi.TrainerGroupSpec) -> str:
    return json.dumps(tgapi.to_wire(spec), sort_keys=True)


def infeasible_fix(spec: tgapi.TrainerGroupSpec, nodes: Sequence[Mapping[str, float]]) -> str:
    """What to change in the spec (or the head) when the cluster can never hold the group."""
    w = spec.workers
    gpus = sum(n.get("GPU", 0.0) for n in nodes)
    cpus = sum(n.get("CPU", 0.0) for n in nodes)
    if w.use_gpu is True and gpus < spec.world_size:
        if gpus == 0:
            return (
                'set workers.useGpu: false (CPU workers, gloo) or "auto", or start the Ray '
                "head with GPUs (`tgctl down --stop-ray`, then `tgctl up`, which detects them, "
                "or `tgctl up --num-gpus N`)"
            )
        return (
            f"the cluster has {gpus:g} GPU(s) for {spec.world_size} GPU workers: lower "
            "workers.processesPerNode (and parallelism to match) or set workers.useGpu: false"
        )
    if w.cpus_per_process * spec.world_size > cpus:
        return (
            f"lower workers.cpusPerProcess (now {w.cpus_per_process:g}; "
            f"{cpus:g} CPUs for {spec.world_size} workers) or workers.processesPerNode, "
            "or start the head with more CPUs (`tgctl up --num-cpus N`)"
        )
    return (
        "lower workers.processesPerNode or workers.cpusPerProcess, choose another "
        "workers.placementStrategy, or add nodes"
    )


def worker_env(spec: tgapi.TrainerGroupSpec) -> dict[str, str]:
    """Environment for every worker actor.

    GPU workers see all GPUs of their node (each still uses only the one Ray assigned it,
    see ``trainer.distributed``): with one visible GPU per process NCCL cannot use direct
    peer-to-peer copies, and tensor-parallel all-reduces get slower.
    """
    return {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if _use_gpu(spec) else {}


def mesh_of(spec: tgapi.TrainerGroupSpec) -> dict[str, int]:
    """The group's parallel mesh sizes, derived from the spec (published in the record)."""
    p = spec.parallelism
    return {"tp": p.tensor, "pp": p.pipeline, "cp": p.context, "dp": spec.data_parallel}
