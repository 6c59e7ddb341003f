"""Training progress in the group record (issue 23), on a real tiny CPU MegatronTrainer group.

Two workers (dp=2, gloo) on the session's Ray head: two ``train_model`` steps, then rank 0's
``training`` in the group record says step 2, and ``tgctl status --json`` (no driver: it
reads the GCS) shows the same. The formatting is tested without Ray in
tests/runtime/test_status_format.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

pytest.importorskip("megatron.core")

from tests.fixtures_ray import RayCluster
from tests.specs import tiny_spec as tiny_resource_spec
from tests.trainer.groups import trainer_group
from tests.trainer.scenarios import BATCH, SEQ, fixed_batch, tiny_spec
from tgapi.progress import TrainingProgress, parse_progress_file, progress_filename
from tgruntime.controller import DataProto, registry
from tgruntime.controller.worker_group import WorkerGroup
from tgruntime.entrypoints import cli

pytestmark = [pytest.mark.ray, pytest.mark.megatron]


def test_two_steps_are_recorded_and_shown_by_status(
    ray_driver: RayCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    wg = trainer_group(tiny_spec(), prefix="progress")
    ray_namespace = ray.get_runtime_context().namespace
    try:
        wg.init_model()
        before = registry.load_record(group_name=wg.group_name, ray_namespace=ray_namespace)
        assert before is not None and before.training is None
        data = DataProto.from_dict(tensors={"input_ids": fixed_batch()})
        started = time.time()
        metas = [wg.train_model(data).meta_info for _ in range(2)]

        # rank 0 writes in the background: the newest value lands within a few seconds
        deadline = time.monotonic() + 30
        while True:
            record = registry.load_record(group_name=wg.group_name, ray_namespace=ray_namespace)
            done = record is not None and record.training is not None and record.training.step == 2
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert record is not None and record.training is not None
        training = record.training
        assert training.step == 2 and training.runs == 1
        assert training.loss == pytest.approx(metas[-1]["loss"], rel=1e-6)
        assert training.grad_norm == pytest.approx(metas[-1]["grad_norm"], rel=1e-6)
        assert training.tokens_per_s == pytest.approx(
            BATCH * SEQ / metas[-1]["step_time_s"], rel=0.05
        )
        assert started <= training.last_step_at <= time.time()

        doc = {
            "apiVersion": "trainergroup.io/v1alpha1",
            "kind": "TrainerGroup",
            "metadata": {"name": wg.group_name},
            "spec": tiny_resource_spec(k8s=False, workers={"rayNamespace": ray_namespace}),
        }
        path = tmp_path / "tg.yaml"
        path.write_text(yaml.safe_dump(doc))
        capsys.readouterr()
        rc = cli.main(["status", "-f", str(path), "--json", "--address", ray_driver.gcs_address])
        body = json.loads(capsys.readouterr().out)
        assert rc == 0 and body["phase"] == "Ready", body
        assert body["training"]["step"] == 2
        assert body["training"]["loss"] == pytest.approx(training.loss)
        assert 0 <= body["training"]["lastStepAgeSeconds"] < 120

        # the operator's path: rank 0's progress file, read through the dashboard's log API
        # from the node rank 0 runs on, says the same
        assert _progress_via_dashboard(ray_driver, wg, ray_namespace) == training
    finally:
        wg.teardown()


def _progress_via_dashboard(
    ray_driver: RayCluster, wg: WorkerGroup, ray_namespace: str
) -> TrainingProgress | None:
    from tg_operator.dashboard import DashboardClient
    from tg_operator.settings import ray_auth_token

    group_name, rank0 = wg.group_name, wg.worker_names[0]

    async def main() -> TrainingProgress | None:
        async with aiohttp.ClientSession() as session:
            dash = DashboardClient(
                base_url=ray_driver.dashboard_url,
                session=session,
                timeout_s=30,
                token=ray_auth_token(os.environ),
            )
            actors = await dash.list_actors(ray_namespace=ray_namespace)
            (actor,) = [a for a in actors if a.name == rank0 and a.state == "ALIVE"]
            filename = progress_filename(ray_namespace=ray_namespace, group_name=group_name)
            text = await dash.node_log_file(node_id=actor.node_id, filename=filename)
            missing = await dash.node_log_file(node_id=actor.node_id, filename=filename + ".no")
            assert missing is None
            return parse_progress_file(text or "")

    return asyncio.run(main())
