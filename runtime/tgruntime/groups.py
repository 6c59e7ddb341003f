"""From a TrainerGroup spec to a running detached worker group, and back.

The server entrypoint, ``tgctl`` and the tests share this: how a spec maps to a
resource pool, a worker class with its init arguments, worker-name prefixes per
group generation, and the payload of the line that announces a ready group
(``tgapi.markers``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Any

import ray

import tgapi
from tgapi import markers
from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from tgruntime.controller.resource_pool import check_feasible, cluster_nodes_resources


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


def name_prefix(tg: tgapi.TrainerGroup, generation: int) -> str:
    """Worker-name prefix: the configured prefix, plus ``-g{N}-`` after the first generation.

    Generation 0 keeps verl's exact shape (``tinyMegatronTrainer_0:1``); a re-created group
    gets new names (``tiny-g1-MegatronTrainer_0:1``) so a stale client can never reach it
    by an old name.
    """
    return tg.name_prefix if generation == 0 else f"{tg.name_prefix}-g{generation}-"


def cluster_gpus() -> float:
    """GPUs in the connected Ray cluster's totals (0 when it has none)."""
    return float(ray.cluster_resources().get("GPU", 0.0))  # type: ignore[no-untyped-call]


def resolve_gpu(tg: tgapi.TrainerGroup, *, gpus: float | None = None) -> tgapi.TrainerGroup:
    """``tg`` with ``workers.useGpu: auto`` resolved against the connected cluster.

    "auto" means GPU workers when the cluster has any GPU, else CPU workers (gloo). The
    server resolves it once, before creating the group: the workers get the resolved spec,
    and the record and the ready line carry the result (``useGpu``).
    """
    if tg.spec.workers.use_gpu != tgapi.USE_GPU_AUTO:
        return tg
    resolved = tg.spec.with_gpu_resolved(cluster_gpus() if gpus is None else gpus)
    return dataclasses.replace(tg, spec=resolved)


def _use_gpu(spec: tgapi.TrainerGroupSpec) -> bool:
    value = spec.workers.use_gpu
    if not isinstance(value, bool):
        raise ValueError(
            f'spec.workers.useGpu is {value!r}: resolve "auto" first (groups.resolve_gpu)'
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


def infeasible_fix(spec: tgapi.TrainerGroupSpec, nodes: list[dict[str, float]]) -> str:
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


def create_group(tg: tgapi.TrainerGroup, *, generation: int) -> WorkerGroup:
    """Create the detached group for ``tg`` (no ``init_model`` yet).

    ``workers.useGpu: auto`` is resolved here if the caller has not (``resolve_gpu``). A
    group the cluster's totals can never hold fails at once with PlacementInfeasibleError,
    naming what was asked, what the cluster has and what to change.
    """
    tg = resolve_gpu(tg)
    pool = resource_pool(tg.spec)
    check_feasible(
        pool,
        group_name=tg.group_name,
        fix=infeasible_fix(tg.spec, cluster_nodes_resources()),
    )
    cls = import_worker_class(tg.spec.workers.worker_class)
    return WorkerGroup.create(
        group_name=tg.group_name,
        ray_namespace=tg.ray_namespace,
        resource_pool=pool,
        cls=ClassWithInitArgs(cls, spec_json(tg.spec)),
        name_prefix=name_prefix(tg, generation),
        detached=True,
        generation=generation,
        pg_timeout_s=float(tg.spec.timeouts.workers_ready_seconds),
        actor_timeout_s=float(tg.spec.timeouts.workers_ready_seconds),
        mesh=mesh_of(tg.spec),
        env=worker_env(tg.spec),
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


def device_summary(init_results: Any) -> dict[str, Any]:
    """What the workers run on, from their ``init_model`` results (one dict per rank).

    The built-in trainer's ranks report ``device`` ("cuda:0", "cpu"), ``backend`` and
    ``dtype``; the summary is {"device": "cuda"|"cpu", "backend": "nccl"|"gloo", "dtype":
    ...}, with "mixed" where ranks disagree. Empty for a worker class that reports none.
    """
    if not isinstance(init_results, list | tuple):
        return {}
    ranks = [r for r in init_results if isinstance(r, dict) and "device" in r]
    if not ranks:
        return {}
    out: dict[str, Any] = {}
    for key in ("device", "backend", "dtype"):
        values = sorted({str(r.get(key, "")).split(":", 1)[0] for r in ranks} - {""})
        if values:
            out[key] = values[0] if len(values) == 1 else "mixed"
    return out


def resume_summary(init_results: Any) -> dict[str, Any]:
    """Where the workers resumed from, from their ``init_model`` results: ``resumedFrom``
    (the checkpoint every rank loaded; "" when none did, "mixed" when ranks disagree) and
    ``resumedStep`` (the optimizer step the workers start from)."""
    if not isinstance(init_results, list | tuple):
        return {}
    ranks = [r for r in init_results if isinstance(r, dict) and "resumed_from" in r]
    if not ranks:
        return {}
    paths = {str(r.get("resumed_from") or "") for r in ranks}
    steps = {int(r.get("step") or 0) for r in ranks}
    return {
        "resumedFrom": paths.pop() if len(paths) == 1 else "mixed",
        "resumedStep": steps.pop() if len(steps) == 1 else -1,
    }


def ready_payload(
    wg: WorkerGroup,
    *,
    mesh: dict[str, int] | None,
    worker_class: str,
    use_gpu: bool | None = None,
    device: dict[str, Any] | None = None,
    resumed: dict[str, Any] | None = None,
) -> markers.GroupReady:
    """The body of the ``TG_GROUP_READY`` line (tgapi.markers, docs/contracts.md).

    ``use_gpu``: workers.useGpu as resolved ("auto" decided against the cluster); ``device``
    / ``backend`` / ``dtype``: what the workers actually run on (``device_summary``), e.g.
    a GPU request that found no CUDA in the workers falls back to "cpu" / "gloo".
    """
    dev = device or {}
    rs = resumed or {}
    return markers.GroupReady(
        group_name=wg.group_name,
        ray_namespace=wg.ray_namespace,
        generation=wg.generation,
        worker_names=tuple(wg.worker_names),
        world_size=wg.world_size,
        mesh=mesh or {},
        worker_class=worker_class,
        use_gpu=use_gpu,
        device=str(dev.get("device", "")),
        backend=str(dev.get("backend", "")),
        dtype=str(dev.get("dtype", "")),
        resumed_from=str(rs["resumedFrom"]) if rs.get("resumedFrom") else None,
        resumed_step=int(rs["resumedStep"]) if rs.get("resumedStep") is not None else None,
    )
