"""8 concurrent SDK clients on loopback: nothing lost or reordered, every future resolves.

Each client sends its own prompts (and partly its own seeds), and must get under load exactly
what it got alone: a reply delivered to the wrong client, or rows of a joint batch handed to
the wrong request, changes some client's tokens."""

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
    errors: list[BaseException] = []

    def client(i: int, results: dict[int, list[list[int]]]) -> None:
        """Client ``i``'s own 4 requests: its own prompts; seeds 0 and 1 shared by every
        client (so requests of different clients can join one batch), 2 and 3 its own."""
        try:
            with _sc(served) as c:
                sampler = c.create_sampling_client(model_path=path)
                futures = [
                    sampler.sample(
                        T.ModelInput.from_ints([3 + i, 4 + j, 5 + 2 * i, 6 + j]), num_samples=2,
                        sampling_params=T.SamplingParams(max_tokens=4, seed=seed, stop=[]),
                    )
                    for j, seed in enumerate((0, 1, 100 + 2 * i, 101 + 2 * i))
                ]
                results[i] = [list(s.tokens) for f in futures
                              for s in f.result(timeout=WAIT).sequences]
        except BaseException as exc:
            errors.append(exc)

    alone: dict[int, list[list[int]]] = {}
    for i in range(8):  # each client by itself first: what it must get under load too
        client(i, alone)
    assert not errors, errors
    # the clients' replies differ from one another, so a reply delivered to the wrong client
    # (or rows of a joint batch handed to the wrong request) shows
    replies = [str(r[k : k + 2]) for r in alone.values() for k in range(0, 8, 2)]
    assert len(set(replies)) == 32
    calls0, prompts0 = service.samples.calls, service.samples.prompts
    results: dict[int, list[list[int]]] = {}
    threads = [threading.Thread(target=client, args=(i, results)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    # every client gets what it got alone, in its own order
    for i in range(8):
        assert results[i] == alone[i], i
    assert all(len(r) == 8 for r in results.values())
    calls = service.samples.calls - calls0
    prompts = service.samples.prompts - prompts0
    assert prompts == 32 and calls < prompts, (calls, prompts)  # batched
    # through the continuous engine (the default on a full-weight group): its pool served
    # the rows of several requests together
    cont = service.samples.continuous
    assert cont is not None and cont.pool is not None and cont.overflowed == 0
    assert cont.last["admitted_rows"] >= 64 and cont.last["active_rows"] == 0, cont.last
    assert service.futures.pending() == 0
    assert np.isfinite(losses).all()
