"""A MegatronTrainer group on the test's local Ray, made one way for every Ray+Megatron test."""

from __future__ import annotations

import json
import uuid

import ray

import tgapi
from tgruntime.controller import ClassWithInitArgs, ResourcePool, WorkerGroup
from tgruntime.trainer.worker import MegatronTrainer


def trainer_group(spec: tgapi.TrainerGroupSpec, *, prefix: str, world: int = 2) -> WorkerGroup:
    """``world`` CPU workers (not detached) in the current Ray namespace; init_model not called."""
    return WorkerGroup.create(
        group_name=f"{prefix}-{uuid.uuid4().hex[:8]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[world], use_gpu=False, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(spec))),
        detached=False,
        pg_timeout_s=120,
        actor_timeout_s=180,
    )
