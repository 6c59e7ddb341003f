"""Many LoRA runs on one group (``lora.runs.RunSet`` through ``MegatronTrainer``; CPU, gloo, TP=2).

One launch of two processes drives ``MegatronTrainer`` with ``spec.lora`` directly (no Ray),
as the Ray group would: every call goes to both ranks in the same order. It runs:

* run ``a`` alone (3 steps), then run ``b`` alone (3 steps, another adapter seed): the
  reference curves;
* runs ``a2`` (= a's settings) and ``b2`` (= b's) interleaved call by call, with a gradient
  pending in one run while the other steps, and ``a2`` parked (written to disk, memory
  freed) mid-accumulation and brought back;
* isolation: ``b2``'s calls leave ``a2``'s adapters and the group's own run bit-identical;
* ``save_run`` after a2's second step, ``load_run`` into a new run ``c``: c's next step
  equals a2's third; a load into a run of another rank, and of another base model (a worker
  whose model seed differs), is refused;
* a rank beyond the hidden size is refused and leaves the runs as they were.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.trainer import lora_scenarios
from tests.trainer.scenarios import _quiet, fixed_batch, tiny_spec

pytestmark = pytest.mark.megatron

MODEL = lora_scenarios.MODEL
TP = 2
A = {"rank": 4, "alpha": 8.0, "seed": 1}
B = {"rank": 2, "alpha": 4.0, "seed": 2, "train_mlp": False}


def _batch(seed: int) -> Any:
    from tgruntime.controller import DataProto

    return DataProto.from_dict(tensors={"input_ids": fixed_batch(seed)})


def _fb(worker: Any, seed: int) -> float:
    out = worker.forward_backward(_batch(seed), reduction="sum")
    return float(out.meta_info["loss"])


def _step(worker: Any) -> dict[str, Any]:
    return dict(worker.optim_step(lr=1e-2))


def _adapters(worker: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in worker.engine.adapters.state_dict().items()}


def _alone(worker: Any, run: str, settings: dict[str, Any], seeds: list[int]) -> list[float]:
    worker.create_run(run, json.dumps(settings))
    losses = []
    for s in seeds:
        losses.append(_fb(worker, s))
        _step(worker)
    return losses


def _worker(spec_json: str) -> Any:
    from tgruntime.trainer.worker import MegatronTrainer

    worker = MegatronTrainer(spec_json)
    worker.init_model()
    return worker


def runs_suite(*, out_dir: str) -> bytes:
    _quiet()
    import tgapi
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    root = Path(out_dir)
    init_process_group(resolve_settings(tiny_spec(**MODEL)))
    wire = tgapi.to_wire(tiny_spec(tp=TP, **MODEL))
    wire["lora"] = {"rank": 4, "alpha": 8}
    result: dict[str, Any] = {}
    try:
        worker = _worker(json.dumps(wire))
        try:
            own = _adapters(worker)  # the group's own run ("default")
            result["a_alone"] = _alone(worker, "a", A, [0, 1, 2])
            result["b_alone"] = _alone(worker, "b", B, [3, 4, 5])

            worker.create_run("a2", json.dumps(A))
            worker.create_run("b2", json.dumps(B))
            a2, b2 = [], []
            worker.use_run("a2")
            a2.append(_fb(worker, 0))  # a2: a gradient pending
            worker.use_run("b2")
            b2.append(_fb(worker, 3))
            _step(worker)
            worker.use_run("a2")
            _step(worker)
            worker.use_run("b2")
            b2.append(_fb(worker, 4))
            _step(worker)
            worker.use_run("a2")
            a2.append(_fb(worker, 1))
            result["a2_after_step2"] = _step(worker)
            worker.save_run(str(root / "a2-step2"))
            a2_before = _adapters(worker)
            a2.append(_fb(worker, 2))  # pending, then parked with it
            result["parked"] = worker.park_run("a2", str(root / "parked-a2"))
            worker.use_run("b2")
            b2.append(_fb(worker, 5))
            _step(worker)
            result["a2_untouched_by_b2"] = all(
                torch.equal(a2_before[k], v)
                for k, v in torch.load(
                    root / "parked-a2" / _run_file_name(), weights_only=True
                )["adapters"].items()
            )
            result["runs_with_a2_parked"] = worker.list_runs()
            worker.use_run("a2")  # back from disk, with its pending gradient
            result["a2_step3"] = _step(worker)
            result["a2_final"] = _adapters(worker)
            worker.use_run("a")
            result["a_final"] = _adapters(worker)
            result["a2"], result["b2"] = a2, b2
            worker.use_run("default")
            result["own_untouched"] = all(
                torch.equal(own[k], v) for k, v in _adapters(worker).items()
            )

            worker.create_run("c", json.dumps(A))
            result["c_loaded_step"] = worker.load_run(str(root / "a2-step2"))
            result["c_loss"] = _fb(worker, 2)
            worker.create_run("small", json.dumps({"rank": 2, "alpha": 8.0}))
            try:
                worker.load_run(str(root / "a2-step2"))
            except ValueError as exc:
                result["other_rank"] = str(exc)
            before = worker.list_runs()
            try:
                worker.create_run("huge", json.dumps({"rank": 65}))
            except ValueError as exc:
                result["huge"] = str(exc)
            result["runs_after_refusal"] = (before, worker.list_runs())
            result["loss_after_refusal"] = _fb(worker, 0)
        finally:
            worker.shutdown()

        other = {**wire, "model": {**wire["model"], "seed": 4321}}
        worker = _worker(json.dumps(other))
        try:
            worker.create_run("x", json.dumps(A))
            try:
                worker.load_run(str(root / "a2-step2"))
            except ValueError as exc:
                result["other_base"] = str(exc)
        finally:
            worker.shutdown()
        buffer = io.BytesIO()
        torch.save(result, buffer)
        return buffer.getvalue()
    finally:
        dist.destroy_process_group()


def _run_file_name() -> str:
    from tgruntime.trainer.lora.runs import run_file

    return run_file(".").name


# -- the tests --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tgruntime.trainer.launch import launch

    root = tmp_path_factory.mktemp("lora-runs")
    blobs = launch(runs_suite, world_size=TP, kwargs={"out_dir": str(root)}, timeout_s=400)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


def test_interleaved_runs_follow_their_curves_alone(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["a2"] == r["a_alone"], (r["a2"], r["a_alone"])
        assert r["b2"] == r["b_alone"], (r["b2"], r["b_alone"])
        assert r["a2_step3"]["step"] == 3
        # the third update came after a park with the gradient pending: still bit-identical
        assert all(torch.equal(r["a_final"][k], v) for k, v in r["a2_final"].items())
        assert r["a_alone"] != r["b_alone"]


def test_a_run_never_changes_another(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["a2_untouched_by_b2"]
        assert r["own_untouched"]


def test_a_parked_run_frees_its_place_and_comes_back(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["parked"]["parked"] is True
        listed = {run["id"]: run for run in r["runs_with_a2_parked"]}
        assert listed["a2"]["parked"] and not listed["a2"]["active"]
        assert listed["b2"]["active"] and listed["b2"]["steps"] == 3
        assert set(listed) == {"default", "a", "b", "a2", "b2"}


def test_save_then_load_into_a_new_run_continues_the_curve(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["c_loaded_step"] == 2
        assert r["c_loss"] == r["a2"][2]


def test_bad_loads_and_sizes_are_refused_cleanly(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "lora.rank 4" in r["other_rank"] and "has 2" in r["other_rank"]
        assert "another base model" in r["other_base"]
        assert "rank" in r["huge"] and "65" in r["huge"]
        before, after = r["runs_after_refusal"]
        assert [(x["id"], x["active"]) for x in before] == [(x["id"], x["active"]) for x in after]
        assert math.isfinite(r["loss_after_refusal"])  # the active run still trains
