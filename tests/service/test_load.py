"""8 concurrent SDK clients on loopback: nothing lost or reordered, every future resolves."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import WAIT, _batch, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types


def test_eight_concurrent_clients(served: dict[str, Any]) -> None:
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        path = tc.save_weights_for_sampler("load").result(timeout=WAIT).path
        # one trainer sends 6 calls back to back (seq_ids in flight together): in order
        data = _batch(5)
        futs = []
        for _ in range(3):
            futs.append(tc.forward_backward(data, "cross_entropy"))
            futs.append(tc.optim_step(T.AdamParams(learning_rate=2e-3)))
        losses = [futs[i].result(timeout=WAIT).metrics["loss:sum"] for i in (0, 2, 4)]
        assert losses[0] > losses[1] > losses[2], losses
    service = served["service"]
    calls0, prompts0 = service.samples.calls, service.samples.prompts
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with _sc(served) as c:
                sampler = c.create_sampling_client(model_path=path)
                futures = [
                    sampler.sample(
                        T.ModelInput.from_ints([3, 4, 5, 6 + j]), num_samples=2,
                        sampling_params=T.SamplingParams(max_tokens=4, seed=j, stop=[]),
                    )
                    for j in range(4)
                ]
                results[i] = [list(s.tokens) for f in futures
                              for s in f.result(timeout=WAIT).sequences]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    # the same seeded request gives the same tokens whichever client sent it (in order)
    for i in range(1, 8):
        assert results[i] == results[0]
    assert all(len(r) == 8 for r in results.values())
    calls = service.samples.calls - calls0
    prompts = service.samples.prompts - prompts0
    assert prompts == 32 and calls < prompts, (calls, prompts)  # batched
    assert service.futures.pending() == 0
    assert np.isfinite(losses).all()
