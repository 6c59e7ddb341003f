"""From a TrainerGroup spec to a running detached worker group, and back.

The server entrypoint, ``tgctl`` and the tests share this: how a spec maps to a
resource pool, a worker class with its init arguments, worker-name prefixes per
group generation, and the JSON line that announces a ready group.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import tgspec
from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup

READY_TAG = "TG_GROUP_READY"
FAILED_TAG = "TG_GROUP_FAILED"
TEARDOWN_TAG = "TG_TEARDOWN"
STEP_TAG = "TG_STEP"


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


def name_prefix(tg: tgspec.TrainerGroup, generation: int) -> str:
    """Worker-name prefix: the configured prefix, plus ``-g{N}-`` after the first generation.

    Generation 0 keeps verl's exact shape (``tinyMegatronTrainer_0:1``); a re-created group
    gets new names (``tiny-g1-MegatronTrainer_0:1``) so a stale client can never reach it
    by an old name.
    """
    return tg.name_prefix if generation == 0 else f"{tg.name_prefix}-g{generation}-"


def resource_pool(spec: tgspec.TrainerGroupSpec) -> ResourcePool:
    w = spec.workers
    return ResourcePool(
        process_on_nodes=list(w.processes_per_node),
        use_gpu=w.use_gpu,
        cpus_per_process=w.cpus_per_process,
        strategy=w.placement_strategy,
        detached=True,
    )


def spec_json(spec: tgspec.TrainerGroupSpec) -> str:
    return json.dumps(tgspec.to_wire(spec), sort_keys=True)


def create_group(tg: tgspec.TrainerGroup, *, generation: int) -> WorkerGroup:
    """Create the detached group for ``tg`` (no ``init_model`` yet)."""
    cls = import_worker_class(tg.spec.workers.worker_class)
    return WorkerGroup.create(
        group_name=tg.group_name,
        namespace=tg.ray_namespace,
        resource_pool=resource_pool(tg.spec),
        cls=ClassWithInitArgs(cls, spec_json(tg.spec)),
        name_prefix=name_prefix(tg, generation),
        detached=True,
        generation=generation,
        pg_timeout_s=float(tg.spec.timeouts.workers_ready_seconds),
        actor_timeout_s=float(tg.spec.timeouts.workers_ready_seconds),
        mesh=mesh_of(tg.spec),
        env=worker_env(tg.spec),
    )


def worker_env(spec: tgspec.TrainerGroupSpec) -> dict[str, str]:
    """Environment for every worker actor.

    GPU workers see all GPUs of their node (each still uses only the one Ray assigned it,
    see ``trainer.distributed``): with one visible GPU per process NCCL cannot use direct
    peer-to-peer copies, and tensor-parallel all-reduces get slower.
    """
    return {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if spec.workers.use_gpu else {}


def mesh_of(spec: tgspec.TrainerGroupSpec) -> dict[str, int]:
    """The group's parallel mesh sizes, derived from the spec (published in the record)."""
    p = spec.parallelism
    return {"tp": p.tensor, "pp": p.pipeline, "cp": p.context, "dp": spec.data_parallel}


def ready_payload(
    wg: WorkerGroup, *, mesh: dict[str, int] | None, worker_class: str
) -> dict[str, Any]:
    """The body of the ``TG_GROUP_READY`` line (docs/contracts.md)."""
    return {
        "groupName": wg.group_name,
        "rayNamespace": wg.namespace,
        "generation": wg.generation,
        "workerNames": list(wg.worker_names),
        "worldSize": wg.world_size,
        "mesh": mesh or {},
        "workerClass": worker_class,
    }


def tagged(tag: str, payload: dict[str, Any]) -> str:
    return f"{tag} {json.dumps(payload, sort_keys=True)}"


def parse_tagged(tag: str, text: str) -> dict[str, Any] | None:
    """Find the last ``TAG {json}`` line in ``text`` (e.g. a Ray job's log)."""
    found: dict[str, Any] | None = None
    for line in text.splitlines():
        if line.startswith(tag + " "):
            found = json.loads(line[len(tag) + 1 :])
    return found
