"""TrainerClient against real local groups (the session's Ray head, PP=2 on CPU over gloo).

One group serves the client checks (attach by name, futures submitted back to back,
log-probs collected from the last stage, losses, errors, save_state); a second, new group
then load_state()s the saved files and must reproduce the first group's next losses.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tgapi

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from tests.fixtures_ray import RayCluster  # noqa: E402
from tests.trainer.rl_scenarios import rl_inputs  # noqa: E402
from tests.trainer.scenarios import BATCH, SEQ, fixed_batch, tiny_spec  # noqa: E402
from tgruntime import TrainerClient  # noqa: E402
from tgruntime.controller import (  # noqa: E402
    ClassWithInitArgs,
    DataProto,
    ResourcePool,
    WorkerGroup,
)
from tgruntime.controller.errors import WorkerMethodError  # noqa: E402
from tgruntime.trainer.losses import MissingTensorError  # noqa: E402
from tgruntime.trainer.worker import MegatronTrainer  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

WAIT = 180.0  # seconds for any one call (CPU, shared 2-core machine)


def _new_group(spec: tgapi.TrainerGroupSpec) -> WorkerGroup:
    wg = WorkerGroup.create(
        group_name=f"rl-{uuid.uuid4().hex[:8]}",
        ray_namespace=ray.get_runtime_context().namespace,
        resource_pool=ResourcePool(process_on_nodes=[2], use_gpu=False, strategy="PACK"),
        cls=ClassWithInitArgs(MegatronTrainer, json.dumps(tgapi.to_wire(spec))),
        detached=False,
        pg_timeout_s=120,
        actor_timeout_s=180,
    )
    wg.init_model()
    return wg


@pytest.fixture(scope="module")
def group(ray_driver: RayCluster) -> Iterator[WorkerGroup]:
    wg = _new_group(tiny_spec(pp=2))
    try:
        yield wg
    finally:
        wg.teardown()


@pytest.fixture(scope="module")
def client(group: WorkerGroup) -> TrainerClient:
    return TrainerClient.connect_local(
        group_name=group.group_name, ray_namespace=group.ray_namespace
    )


def _tensor(proto: DataProto, key: str) -> torch.Tensor:
    assert proto.batch is not None, proto
    value: torch.Tensor = proto.batch[key]
    return value


def _policy(client: TrainerClient, seed: int) -> dict[str, torch.Tensor]:
    raw = rl_inputs(seed)
    t = {k: raw[k] for k in ("input_ids", "attention_mask", "loss_mask", "advantages")}
    lp = _tensor(client.compute_log_prob(t).result(timeout=WAIT), "log_probs")
    t["old_log_probs"] = lp + raw["noise_old"] * raw["attention_mask"][:, 1:]
    return t


def test_log_probs_and_losses_through_futures(client: TrainerClient) -> None:
    raw = rl_inputs(3)
    tensors = {k: raw[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    out = client.compute_log_prob(tensors, entropy=True).result(timeout=WAIT)
    lp, ent = _tensor(out, "log_probs"), _tensor(out, "entropy")
    assert tuple(lp.shape) == (BATCH, SEQ - 1) and lp.dtype == torch.float32
    assert tuple(ent.shape) == (BATCH, SEQ - 1) and bool((ent[:, :5] > 0).all())
    assert out.meta_info["rank"] == 1  # collected from the last pipeline stage
    # cross_entropy's per-sample loss is the masked mean of -log_probs: the two paths agree
    fb = client.forward_backward(tensors, loss="cross_entropy").result(timeout=WAIT)
    w = raw["loss_mask"] * raw["attention_mask"][:, 1:]
    expected = -(lp * w).sum(1) / w.sum(1)
    torch.testing.assert_close(_tensor(fb, "loss"), expected, atol=1e-5, rtol=1e-5)
    assert fb.meta_info["tokens"] == pytest.approx(float(w.sum()))
    assert client.zero_grad().result(timeout=WAIT) is True


def test_pipelined_calls_accumulate_then_step(client: TrainerClient) -> None:
    a, b = _policy(client, 4), _policy(client, 5)
    config = {"clip_eps": 0.2}
    # submitted back to back, before any result: the workers run them in order
    f1 = client.forward_backward(a, loss="ppo", loss_config=config)
    f2 = client.forward_backward(b, loss="ppo", loss_config=config)
    f3 = client.optim_step(lr=1e-3)
    f4 = client.train_step({"input_ids": fixed_batch()})
    r1, r2 = f1.result(timeout=WAIT), f2.result(timeout=WAIT)
    step, trained = f3.result(timeout=WAIT), f4.result(timeout=WAIT)
    assert r2.meta_info["accumulated_tokens"] == pytest.approx(
        r1.meta_info["tokens"] + r2.meta_info["tokens"]
    )
    assert 0.0 <= r1.meta_info["metrics/clip_frac"] <= 1.0
    assert step["step"] == 1 and step["lr"] == pytest.approx(1e-3) and not step["skipped"]
    assert step["tokens"] == pytest.approx(r2.meta_info["accumulated_tokens"])
    assert trained.meta_info["step"] == 2 and tuple(_tensor(trained, "loss").shape) == (BATCH,)
    assert f1.done() and f4.done()


def test_errors_name_the_fix(client: TrainerClient) -> None:
    ids = {"input_ids": fixed_batch()}
    with pytest.raises(MissingTensorError, match=r"batch\['advantages'\]"):
        client.forward_backward(ids, loss="ppo")  # refused before sending
    with pytest.raises(WorkerMethodError, match="unknown loss 'nope'"):
        client.forward_backward(ids, loss="nope").result(timeout=WAIT)
    with pytest.raises(WorkerMethodError, match="no gradient accumulated"):
        client.optim_step().result(timeout=WAIT)
    with pytest.raises(WorkerMethodError, match="right-padded"):
        bad = {"input_ids": fixed_batch(), "attention_mask": torch.zeros(BATCH, SEQ)}
        bad["attention_mask"][:, 3] = 1
        client.compute_log_prob(bad).result(timeout=WAIT)
    # a user loss shipped as a function (pickled by value)
    def mean_logp(logp: torch.Tensor, batch: Any, config: Any) -> Any:
        return -logp * float(config["scale"]), {"scale": torch.tensor(float(config["scale"]))}

    out = client.forward_backward(ids, loss=mean_logp, loss_config={"scale": 2.0})
    ce = client.forward_backward(ids, loss="cross_entropy")
    meta, ce_meta = out.result(timeout=WAIT).meta_info, ce.result(timeout=WAIT).meta_info
    assert meta["loss"] == pytest.approx(2 * ce_meta["loss"], rel=1e-5)
    assert meta["metrics/scale"] == pytest.approx(2.0)
    client.zero_grad().result(timeout=WAIT)


def test_save_state_then_new_group_load_state(
    client: TrainerClient, group: WorkerGroup, tmp_path: Path
) -> None:
    path = str(tmp_path / "state")
    saved = client.save_state(path).result(timeout=WAIT)
    assert saved == path and (tmp_path / "state" / "meta.json").is_file()
    step = group.get_mesh()[0]["step"]
    data = {"input_ids": fixed_batch(seed=7)}
    first = [client.train_step(data) for _ in range(2)]
    expected = [f.result(timeout=WAIT).meta_info["loss"] for f in first]

    other = _new_group(tiny_spec(pp=2))
    try:
        fresh = TrainerClient(other)
        assert fresh.load_state(path).result(timeout=WAIT) == step
        got = [fresh.train_step(data).result(timeout=WAIT).meta_info["loss"] for _ in range(2)]
    finally:
        other.teardown()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
