"""Training progress in the group record (issue 23), on a real tiny CPU MegatronTrainer group.

Two workers (dp=2, gloo) on the session's Ray head: two ``train_model`` steps, then rank 0's
``training`` in the group record says step 2, and ``tgctl status --json`` (no driver: it
reads the GCS) shows the same. The formatting is tested without Ray in
tests/runtime/test_status_format.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("megatron.core")

from tests.fixtures_ray import RayCluster
from tests.specs import tiny_spec as tiny_resource_spec
from tests.trainer.groups import trainer_group
from tests.trainer.scenarios import BATCH, SEQ, fixed_batch, tiny_spec
from tgruntime.controller import DataProto, registry
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
    finally:
        wg.teardown()
