"""Continuous batching (docs/sampling.md) on a real TP=2 MegatronTrainer group (Ray, CPU, gloo).

One module-scoped group of two workers (tiny Llama: RoPE, GQA), trained one step, its pool
sized to 6 slots of 24 positions. ``sample_step`` is called as the service's scheduler calls
it, and through the scheduler itself:

* a request sent while another decodes joins that batch (admitted at the engine step the
  long one is at, before it finishes) and, being short, finishes first;
* every request's tokens equal those of the one-shot ``sample`` of that request alone with
  its seed, its log-probs within 1e-5 (different batch shapes round differently on the CPU),
  with different temperature / top-k / top-p / stop / num_samples / prompt_logprobs in one
  batch, and from a saved snapshot (held swapped in between chunks, while a group method run
  between two chunks still sees the training weights);
* sampled log-probs equal ``compute_log_prob`` on the same sequences;
* refusals: prompt + max_tokens over the slot length, num_samples over the slots, a KV budget
  holding no row, a call with other weights while rows decode; the group samples afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from tests.fixtures_ray import RayCluster  # noqa: E402
from tests.trainer.groups import trainer_group  # noqa: E402
from tests.trainer.scenarios import fixed_batch, tiny_spec  # noqa: E402
from tgruntime.controller.errors import WorkerMethodError  # noqa: E402
from tgruntime.driver.trainer_client import TrainerClient  # noqa: E402
from tgruntime.service.continuous import ContinuousJob, ContinuousScheduler  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

SLOTS, LENGTH = 6, 24
REQUESTS: list[tuple[list[int], dict[str, Any]]] = [
    ([3, 17, 42, 5, 9], {"max_tokens": 16, "seed": 1, "num_samples": 2}),
    ([100, 2], {"max_tokens": 4, "seed": 2, "temperature": 0.7, "top_k": 5}),
    (
        [7, 7, 8, 1, 30, 31, 64, 12, 90],
        {"max_tokens": 10, "seed": 3, "top_p": 0.8, "num_samples": 3, "prompt_logprobs": True},
    ),
    ([9, 9], {"max_tokens": 8, "temperature": 0.0}),
    ([5, 6, 7], {"max_tokens": 12, "seed": 9, "stop": [[11], [12, 13]], "temperature": 1.3}),
]


@pytest.fixture(scope="module")
def client(ray_driver: RayCluster) -> Iterator[TrainerClient]:
    spec = tiny_spec(tp=2, positionEmbedding="rope", numQueryGroups=2)
    wg = trainer_group(spec, prefix="contin")
    try:
        wg.init_model()
        c = TrainerClient(wg)
        c.train_step({"input_ids": fixed_batch()}).result()
        info = c.sampler_pool(slots=SLOTS, length=LENGTH).result()
        assert info["slots"] == SLOTS and info["length"] == LENGTH and info["kv_bytes"] > 0
        yield c
    finally:
        wg.teardown()


def _drain(c: TrainerClient, out: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    last: dict[str, Any] = {}
    for _ in range(100):
        last = c.sample_step([], max_steps=5, **kwargs).result()
        out.update(last["finished"])
        if not last["active_rows"] and not last["waiting_requests"]:
            return last
    raise AssertionError(f"the engine did not drain: {last}")


def _request(rid: str, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "prompt": prompt, **params}


def _assert_same(alone: dict[str, Any], got: dict[str, Any]) -> None:
    assert len(alone["sequences"]) == len(got["sequences"])
    for a, g in zip(alone["sequences"], got["sequences"], strict=True):
        assert a["tokens"] == g["tokens"] and a["stop_reason"] == g["stop_reason"]
        torch.testing.assert_close(
            torch.tensor(g["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-5, rtol=0
        )
    if alone["prompt_logprobs"] is None:
        assert got["prompt_logprobs"] is None
    else:
        assert got["prompt_logprobs"][0] is None
        torch.testing.assert_close(
            torch.tensor(got["prompt_logprobs"][1:]),
            torch.tensor(alone["prompt_logprobs"][1:]),
            atol=1e-5,
            rtol=0,
        )


def test_a_request_joins_the_running_batch_and_a_short_one_finishes_first(
    client: TrainerClient,
) -> None:
    first = client.sample_step(
        [_request("long", [3, 4, 5], {"max_tokens": 18, "seed": 4})], max_steps=3
    ).result()
    assert first["finished"] == {} and first["active_rows"] == 1
    at = first["steps"]
    second = client.sample_step(
        [_request("short", [8, 9], {"max_tokens": 3, "seed": 5})], max_steps=4
    ).result()
    short = second["finished"]["short"]
    assert second["active_rows"] == 1  # the long one still decodes
    out: dict[str, Any] = {}
    _drain(client, out)
    long = out["long"]
    # the short request was admitted while the long one decoded, into its batch
    assert long["engine"]["admitted_step"] < short["engine"]["admitted_step"] == at
    assert short["engine"]["finished_step"] < long["engine"]["finished_step"]
    assert short["engine"]["finished_step"] - short["engine"]["admitted_step"] == 2  # 3 tokens
    assert len(long["sequences"][0]["tokens"]) == 18
    alone = client.sample([[3, 4, 5]], max_tokens=18, seed=4).result()[0]
    _assert_same(alone, long)


def test_results_equal_each_request_alone(client: TrainerClient) -> None:
    got: dict[str, Any] = {}
    base = client.sample_step([], max_steps=0).result()
    out = client.sample_step([_request("r0", *REQUESTS[0])], max_steps=3).result()
    got.update(out["finished"])
    for i, (prompt, params) in enumerate(REQUESTS[1:], start=1):  # each while others decode
        out = client.sample_step([_request(f"r{i}", prompt, params)], max_steps=2).result()
        assert not out["failed"], out["failed"]
        got.update(out["finished"])
    waited = out["waiting_requests"]  # 9 rows for 6 slots: the last request had to wait
    last = _drain(client, got)
    # 8 rows, 5 prompts prefilled: a request's samples share one prefill of its prompt
    assert last["admitted_rows"] - base["admitted_rows"] == 8
    assert last["prefilled_prompts"] - base["prefilled_prompts"] == len(REQUESTS)
    assert waited == 1 and got["r4"]["engine"]["admitted_step"] > got["r4"]["engine"][
        "submitted_step"
    ]
    for i, (prompt, params) in enumerate(REQUESTS):
        alone = client.sample([prompt], **params).result()[0]
        _assert_same(alone, got[f"r{i}"])
    assert got["r2"]["prompt_logprobs"] is not None


def test_a_stop_inside_a_window_ends_the_row_there(client: TrainerClient) -> None:
    """Steps run in windows of up to 16 with the stop checks after each (continuous.py): a row
    that meets its stop sequence at its 4th token, inside a 16-step window, ends there (its
    later tokens dropped, its slot freed), its rows' tokens equal its run alone up to the stop,
    and a long request beside it is untouched."""
    free = client.sample([[21, 4, 8]], max_tokens=12, temperature=0.0).result()[0]
    tokens = free["sequences"][0]["tokens"]
    stop = tokens[2:4]  # the 3rd and 4th tokens: a two-token stop sequence
    cut = next(i for i in range(2, len(tokens) + 1) if tokens[i - 2 : i] == stop)
    admit = [
        _request("long", [3, 4, 5], {"max_tokens": 18, "seed": 4}),
        _request("stops", [21, 4, 8], {"max_tokens": 12, "temperature": 0.0, "stop": [stop]}),
    ]
    out = client.sample_step(admit, max_steps=16).result()
    assert set(out["finished"]) == {"stops"} and out["active_rows"] == 1
    got = out["finished"]["stops"]["sequences"][0]
    assert got["stop_reason"] == "stop" and got["tokens"] == tokens[:cut]
    engine = out["finished"]["stops"]["engine"]
    assert engine["finished_step"] - engine["admitted_step"] == cut - 1  # exact, not the window's
    rest: dict[str, Any] = {}
    _drain(client, rest)
    alone = client.sample([[3, 4, 5]], max_tokens=18, seed=4).result()[0]
    _assert_same(alone, rest["long"])


def test_topk_sample_logprobs_are_int_ids_with_the_sampled_token(client: TrainerClient) -> None:
    """``topk_sample_logprobs`` through the engine: per token, k (int id, log-prob) pairs in
    descending order; under greedy sampling the chosen token is the first, with its log-prob
    (the window buffers carry the ids as floats to the host; they must come back as ints)."""
    req = _request("tk", [3, 17, 42], {"max_tokens": 20, "temperature": 0.0,
                                        "logprob_options": {"topk_sample_logprobs": 3}})
    got: dict[str, Any] = {}
    out = client.sample_step([req], max_steps=20).result()
    assert not out["failed"], out["failed"]
    got.update(out["finished"])
    _drain(client, got)
    seq = got["tk"]["sequences"][0]
    assert len(seq["topk_logprobs"]) == len(seq["tokens"]) == 20
    for token, lp, pairs in zip(seq["tokens"], seq["logprobs"], seq["topk_logprobs"], strict=True):
        assert len(pairs) == 3 and all(type(i) is int for i, _ in pairs)
        assert pairs[0][0] == token and abs(pairs[0][1] - lp) < 1e-5
        assert pairs[0][1] >= pairs[1][1] >= pairs[2][1]


def test_sampled_logprobs_equal_compute_log_prob(client: TrainerClient) -> None:
    prompts = [[3, 17, 42, 5, 9], [100, 2], [7, 7, 8, 1, 30]]
    admit = [_request(f"p{i}", p, {"max_tokens": 10, "seed": 7 + i}) for i, p in enumerate(prompts)]
    got: dict[str, Any] = {}
    got.update(client.sample_step(admit[:1], max_steps=4).result()["finished"])
    got.update(client.sample_step(admit[1:], max_steps=1).result()["finished"])
    _drain(client, got)
    seqs = [p + got[f"p{i}"]["sequences"][0]["tokens"] for i, p in enumerate(prompts)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    batch = client.compute_log_prob({"input_ids": ids, "attention_mask": mask}).result().batch
    assert batch is not None
    for i, p in enumerate(prompts):
        want = batch["log_probs"][i, len(p) - 1 : len(seqs[i]) - 1]
        have = torch.tensor(got[f"p{i}"]["sequences"][0]["logprobs"])
        torch.testing.assert_close(have, want.float(), atol=1e-4, rtol=0)


def test_snapshot_weights_and_one_weights_at_a_time(client: TrainerClient) -> None:
    client.save_sampler_weights("cb-snap").result()
    fb = client.forward_backward({"input_ids": fixed_batch(seed=5)})
    client.optim_step(lr=5e-2).result()
    fb.result()
    prompt, params = [3, 17, 42], dict[str, Any](max_tokens=8, seed=11)
    probe = {"input_ids": fixed_batch(seed=6)}
    live = client.compute_log_prob(probe).result().batch
    out = client.sample_step(
        [_request("s", prompt, params)], max_steps=2, weights="cb-snap"
    ).result()
    with pytest.raises(WorkerMethodError, match="decoding rows of weights 'cb-snap'"):
        client.sample_step([_request("t", prompt, params)], max_steps=1).result()
    got: dict[str, Any] = dict(out["finished"])
    got.update(client.sample_step([], max_steps=1, weights="cb-snap").result()["finished"])
    # the snapshot stays swapped in between chunks; any other group method sees (and the
    # chunks after it get back) the training weights, bit for bit
    between = client.compute_log_prob(probe).result().batch
    assert live is not None and between is not None
    assert torch.equal(between["log_probs"], live["log_probs"])
    _drain(client, got, weights="cb-snap")
    snap = client.sample([prompt], weights="cb-snap", **params).result()[0]
    now = client.sample([prompt], **params).result()[0]
    _assert_same(snap, got["s"])
    assert now["sequences"][0]["tokens"] != snap["sequences"][0]["tokens"]
    unknown = client.sample_step([_request("u", prompt, params)], max_steps=1, weights="nope")
    assert "no sampler weights" in unknown.result()["failed"]["u"]


def test_bad_requests_are_refused_and_the_group_stays_usable(client: TrainerClient) -> None:
    admit = [
        _request("long", [1] * 10, {"max_tokens": LENGTH - 9}),
        _request("many", [1, 2], {"max_tokens": 2, "num_samples": SLOTS + 1}),
        _request("vocab", [10_000], {"max_tokens": 2}),
        _request("topp", [1], {"max_tokens": 2, "top_p": 0.0}),
        _request("ok", [1, 2], {"max_tokens": 2, "seed": 0}),
    ]
    out = client.sample_step(admit, max_steps=4).result()
    failed = out["failed"]
    assert "exceeds the sampler's slot length of 24 positions" in failed["long"]
    assert f"num_samples {SLOTS + 1} is over the sampler's row limit" in failed["many"]
    assert "outside the vocabulary" in failed["vocab"] and "top_p" in failed["topp"]
    assert set(failed) == {"long", "many", "vocab", "topp"} and "ok" in out["finished"]
    with pytest.raises(WorkerMethodError, match=r"KV budget of 100 bytes holds no row"):
        client.sampler_pool(kv_bytes=100).result()
    # the old pool stays, and both paths still sample
    out = client.sample_step([_request("after", [1, 2], {"max_tokens": 2})], max_steps=2).result()
    assert out["slots"] == SLOTS and len(out["finished"]["after"]["sequences"][0]["tokens"]) == 2
    assert len(client.sample([[1, 2]], max_tokens=2, seed=0).result()) == 1


def test_the_scheduler_serves_concurrent_requests_in_one_batch(client: TrainerClient) -> None:
    """Through the service's scheduler: a long request, then three that arrive while it
    decodes; each is served by the running batch and equals the one-shot result."""

    async def main() -> dict[str, Any]:
        async def step(
            admit: list[dict[str, Any]], k: int, weights: str | None, reset: bool
        ) -> dict[str, Any]:
            future = client.sample_step(admit, max_steps=k, weights=weights, reset=reset)
            out: dict[str, Any] = await asyncio.to_thread(future.result, 120)
            return out

        sched = ContinuousScheduler(step, steps=4, steps_busy=2)
        sched.start()
        results: dict[int, Any] = {}
        finished_order: list[int] = []

        def job(i: int, prompt: list[int], max_tokens: int) -> ContinuousJob:
            def done(result: dict[str, Any] | None, exc: BaseException | None) -> None:
                results[i] = exc if exc is not None else result
                finished_order.append(i)

            request = {"prompt": prompt, "max_tokens": max_tokens, "seed": 20 + i}
            return ContinuousJob(None, request, done)

        sched.put(job(0, [4, 5, 6], 20))
        while sched.calls < 2:
            await asyncio.sleep(0.01)
        for i in (1, 2, 3):
            sched.put(job(i, [i, 2 * i], 3))
        for _ in range(6000):
            await asyncio.sleep(0.02)
            if len(results) == 4:
                break
        await sched.stop()
        return {"results": results, "order": finished_order}

    out = asyncio.run(main())
    res = out["results"]
    assert out["order"][-1] == 0, out["order"]  # the long one, sent first, finishes last
    long_engine = res[0]["engine"]
    for i in (1, 2, 3):
        e = res[i]["engine"]
        assert long_engine["admitted_step"] < e["admitted_step"] < long_engine["finished_step"]
        alone = client.sample([[i, 2 * i]], max_tokens=3, seed=20 + i).result()[0]
        _assert_same(alone, res[i])
    _assert_same(client.sample([[4, 5, 6]], max_tokens=20, seed=20).result()[0], res[0])
