"""A request larger than the token budget, through the unmodified SDK (TP=2 group of its own
with ``spec.training.microBatchTokens`` set, CPU, gloo).

One ``forward_backward`` of 5x the budget equals the same rows sent in budget-sized calls:
the summed loss, the per-token logprobs, the gradient norm at ``optim_step`` and the next
step's loss. A single sequence longer than the budget is refused with the budget's number,
and the group stays usable: the refusal leaves no trace in the next step's result.
(tests/trainer/test_token_budget.py covers the split inside one engine, every loss; this is
the same contract through the server and the SDK.)"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import _datum

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
WAIT = 300.0
ROW = 33  # tokens per sequence: 32 input positions (the budget counts rows x padded length)
BUDGET = 2 * (ROW - 1)  # two rows per micro-batch
ROWS = 10  # the whole call: 5x the budget


@pytest.fixture(scope="module")
def budgeted(service_driver: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.service.conftest import MODEL, serving
    from tests.trainer.scenarios import tiny_spec

    root = tmp_path_factory.mktemp("budget")
    spec = tiny_spec(tp=2, checkpoint_dir=str(root / "ckpt"), **MODEL)  # type: ignore[arg-type]
    spec = dataclasses.replace(
        spec, training=dataclasses.replace(spec.training, micro_batch_tokens=BUDGET)
    )
    with serving(spec, root, prefix="budget") as s:
        yield s


def _rows(seed: int, n: int, length: int) -> list[Any]:
    g = np.random.default_rng(seed)
    return [_datum([int(t) for t in g.integers(2, 128, size=length)]) for _ in range(n)]


def _run(served: dict[str, Any], chunks: list[list[Any]], *, refuse: Any = None) -> dict[str, Any]:
    """From the base weights (a new session's model): forward_backward over ``chunks`` (one
    call each), optim_step, then the next step's forward; ``refuse``: a datum sent first,
    whose refusal is recorded."""
    adam = T.AdamParams(learning_rate=1e-2)
    out: dict[str, Any] = {}
    with tinker.ServiceClient(base_url=served["url"], api_key=served["key"]) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result(
            timeout=WAIT
        )
        if refuse is not None:
            t0 = time.monotonic()
            with pytest.raises(Exception) as err:
                tc.forward_backward([refuse], "cross_entropy").result(timeout=WAIT)
            out["refused"], out["refused_s"] = str(err.value), time.monotonic() - t0
        futures = [tc.forward_backward(c, "cross_entropy") for c in chunks]
        results = [f.result(timeout=WAIT) for f in futures]
        out["loss"] = sum(r.metrics["loss:sum"] for r in results)
        out["logprobs"] = np.concatenate(
            [o["logprobs"].to_numpy() for r in results for o in r.loss_fn_outputs]
        )
        out["grad_norm"] = tc.optim_step(adam).result(timeout=WAIT).metrics["grad_norm:last"]
        data = [d for c in chunks for d in c]
        out["next"] = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
    return out


def test_a_request_5x_the_budget_equals_budget_sized_calls(budgeted: dict[str, Any]) -> None:
    data = _rows(5, ROWS, ROW)
    assert ROWS * (ROW - 1) == 5 * BUDGET
    whole = _run(budgeted, [data])
    # the same rows in calls of one budget each; an over-long row refused first
    long_row = _datum(list(range(2, 2 + BUDGET + 2)))  # BUDGET + 1 input positions
    split = _run(budgeted, [data[i : i + 2] for i in range(0, ROWS, 2)], refuse=long_row)
    refused = split["refused"]
    assert f"does not fit one micro-batch of {BUDGET} tokens" in refused, refused
    assert "spec.training.microBatchTokens" in refused, refused
    assert split["refused_s"] < 60, split["refused_s"]
    rel = 1e-5
    assert abs(whole["loss"] - split["loss"]) <= rel * abs(whole["loss"]), (whole, split)
    np.testing.assert_allclose(whole["logprobs"], split["logprobs"], atol=1e-5)
    assert whole["grad_norm"] > 0
    assert abs(whole["grad_norm"] - split["grad_norm"]) <= 1e-4 * whole["grad_norm"]
    # the next step's result: the same weights after the step, the refusal left no trace
    assert abs(whole["next"] - split["next"]) <= 1e-4 * abs(whole["next"]), (whole, split)
    assert whole["next"] < whole["loss"]  # the step trained
