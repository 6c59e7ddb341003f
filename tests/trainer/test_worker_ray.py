"""MegatronTrainer as a real Ray worker group (local Ray, TP=2 on CPU over gloo).

init_model -> train_model(DataProto) x 3 -> save_checkpoint -> health -> teardown.
The full detached server/client flow is tested with the entrypoints; this checks the
worker's own contract: mesh registration, dp-sharded dispatch, output format, metrics.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import megatron.core  # noqa: F401
import pytest
import ray

import tgapi
from tests.fixtures_ray import RayCluster
from tests.trainer.scenarios import BATCH, SEQ, fixed_batch, tiny_spec
from tgruntime.controller import (
    ClassWithInitArgs,
    DataProto,
    ResourcePool,
    WorkerGroup,
)
from tgruntime.trainer.worker import MegatronTrainer

pytestmark = [pytest.mark.ray, pytest.mark.megatron]


@pytest.fixture(scope="module")
def group(
    ray_driver: RayCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerGroup, Path]]:
    ckpt = tmp_path_factory.mktemp("worker-ckpt")
    spec = tiny_spec(tp=2, checkpoint_dir=str(ckpt))
    wire = json.dumps(tgapi.to_wire(spec))
    wg = WorkerGroup.create(
        group_name=f"trainer-{uuid.uuid4().hex[:8]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[2], use_gpu=False, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, wire),
        detached=False,
        pg_timeout_s=120,
        actor_timeout_s=180,
    )
    try:
        yield wg, ckpt
    finally:
        wg.teardown()


def test_worker_group_trains_and_checkpoints(group: tuple[WorkerGroup, Path]) -> None:
    wg, ckpt = group
    meshes: list[dict[str, Any]] = wg.init_model()
    assert [m["tp_rank"] for m in meshes] == [0, 1]
    assert [m["is_collect"] for m in meshes] == [True, False]
    assert all(m["resumed_from"] is None for m in meshes)

    data = DataProto.from_dict(tensors={"input_ids": fixed_batch()})
    losses = []
    for step in range(1, 4):
        out = wg.train_model(data)
        assert tuple(out.batch["loss"].shape) == (BATCH,)
        meta = out.meta_info
        assert meta["step"] == step and meta["tokens"] == BATCH * SEQ
        assert meta["rank"] == 0 and meta["dp_rank"] == 0
        assert meta["step_time_s"] > 0 and meta["grad_norm"] > 0
        assert float(out.batch["loss"].mean()) == pytest.approx(meta["loss"], rel=1e-5)
        losses.append(meta["loss"])
    assert losses[-1] < losses[0] - 0.05, losses
    # the mesh is added to the last step when read (train_model no longer counts parameters)
    last = wg.last_step()
    assert [x["tp_rank"] for x in last] == [0, 1] and [x["step"] for x in last] == [3, 3]
    assert [x["rank"] for x in last] == [0, 1] and last[0]["loss"] == pytest.approx(losses[-1])
    assert last[0]["parameters"] == meshes[0]["parameters"]

    paths = wg.save_checkpoint()
    assert paths == [str(ckpt / "step_00000003")] * 2
    assert (ckpt / "step_00000003" / "meta.json").is_file()
    health = wg.call("health")  # the worker's own ping (wg.health() is Ray's view of the actors)
    assert [h["step"] for h in health] == [3, 3] and all(h["ok"] for h in health)
    assert wg.shutdown() == [True, True]
