"""Continuous batching on a LoRA group (issue 35): every request with its own adapter, one batch.

One module-scoped TP=2 group (Ray, CPU, gloo; tiny Llama: RoPE, GQA) with ``spec.lora``, two
runs trained a few steps at a high learning rate and snapshotted: ``a-snap`` (rank 4) and
``b-snap`` (rank 2, no MLP adapters); the pool sized to 6 slots of 24 positions. Checked:

* requests for a, b and the base, each sent in its own ``sample_step`` call while the others
  decode, are served in one running batch (admitted before the first one finishes; the
  adapter stack rebuilt with the union, never waiting for a drain), and each equals the
  one-shot ``sample`` / ``sample_batch`` of that request alone with its seed (tokens; log-probs
  within 1e-5), prompt log-probs included;
* sampled log-probs equal ``compute_log_prob`` under that adapter (1e-4);
* a request naming an unknown adapter (or a bad one) fails alone; the rest are served, the
  active run's function is untouched and both paths still sample;
* a run's next snapshot takes the old one's slot in place (a refill, no rebuild), and
  samples as it does alone;
* through the service's ``SampleQueue`` (``multi_lora``): requests for the three weights go to
  the continuous engine, in one batch, with what each gives alone.
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
from tgruntime.driver.trainer_client import TrainerClient  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

SLOTS, LENGTH = 6, 24
LR = 5e-2
RUNS: dict[str, dict[str, Any]] = {
    "a": {"rank": 4, "alpha": 8.0, "seed": 1},
    "b": {"rank": 2, "alpha": 4.0, "seed": 2, "train_mlp": False},
}
# (id, weights, prompt, parameters): each sent in a call of its own while the others decode
REQUESTS: list[tuple[str, str | None, list[int], dict[str, Any]]] = [
    ("a0", "a-snap", [3, 17, 42, 5, 9], {"max_tokens": 14, "seed": 1, "num_samples": 2}),
    ("b0", "b-snap", [100, 2], {"max_tokens": 6, "seed": 2, "temperature": 0.7, "top_k": 5}),
    (
        "base0",
        None,
        [7, 7, 8, 1, 30, 31],
        {"max_tokens": 8, "seed": 3, "top_p": 0.8, "prompt_logprobs": True},
    ),
    ("a1", "a-snap", [9, 9], {"max_tokens": 5, "temperature": 0.0}),
    ("b1", "b-snap", [5, 6, 7], {"max_tokens": 9, "seed": 9, "stop": [[11], [12, 13]]}),
]


@pytest.fixture(scope="module")
def client(ray_driver: RayCluster) -> Iterator[TrainerClient]:
    import tgapi

    wire = tgapi.to_wire(tiny_spec(tp=2, positionEmbedding="rope", numQueryGroups=2))
    wire["lora"] = {"rank": 4, "alpha": 8}
    wg = trainer_group(tgapi.parse_spec(wire, local=True), prefix="contlora")
    try:
        wg.init_model()
        c = TrainerClient(wg)
        for run, settings in RUNS.items():
            c.create_run(run, settings).result()
            for seed in (0, 1):
                c.forward_backward({"input_ids": fixed_batch(seed)}).result()
                c.optim_step(lr=LR).result()
            c.save_sampler_weights(f"{run}-snap").result()
        info = c.sampler_pool(slots=SLOTS, length=LENGTH).result()
        assert info["slots"] == SLOTS and info["length"] == LENGTH
        yield c
    finally:
        wg.teardown()


def _request(rid: str, weights: str | None, prompt: list[int], params: dict[str, Any]) -> Any:
    return {"id": rid, "prompt": prompt, "weights": weights, **params}


def _drain(c: TrainerClient, out: dict[str, Any]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    for _ in range(100):
        last = c.sample_step([], max_steps=5).result()
        out.update(last["finished"])
        if not last["active_rows"] and not last["waiting_requests"]:
            return last
    raise AssertionError(f"the engine did not drain: {last}")


def _alone(c: TrainerClient, weights: str | None, prompt: list[int], params: Any) -> Any:
    """The one-shot result of one request: ``sample`` with the snapshot, or ``sample_batch``
    with None for the base (``sample``'s None is the active run)."""
    if weights is None:
        return c.sample_batch([prompt], [None], **params).result()[0]
    return c.sample([prompt], weights=weights, **params).result()[0]


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
        torch.testing.assert_close(
            torch.tensor(got["prompt_logprobs"][1:]),
            torch.tensor(alone["prompt_logprobs"][1:]),
            atol=1e-5,
            rtol=0,
        )


def test_requests_for_different_adapters_decode_in_one_batch(client: TrainerClient) -> None:
    got: dict[str, Any] = {}
    infos = []
    for rid, weights, prompt, params in REQUESTS:
        out = client.sample_step([_request(rid, weights, prompt, params)], max_steps=2).result()
        assert not out["failed"], out["failed"]
        got.update(out["finished"])
        infos.append(out)
    last = _drain(client, got)
    assert set(got) == {r[0] for r in REQUESTS}
    first = got["a0"]["engine"]
    for rid in ("b0", "base0", "a1"):  # joined a0's batch while it decoded
        assert first["admitted_step"] < got[rid]["engine"]["admitted_step"]
        assert got[rid]["engine"]["admitted_step"] < first["finished_step"]
    assert infos[1]["active_rows"] == 3  # a0's two rows and b0's: two adapters in one batch
    assert last["adapters"] == 2 and last["adapter_rebuilds"] >= 2
    assert last["decode_path"] == "lean+lora"  # the stack's deltas in the lean layers (TP=2)
    for rid, weights, prompt, params in REQUESTS:
        _assert_same(_alone(client, weights, prompt, params), got[rid])
    # the adapters matter (the comparison has teeth): a's rows are not the base's
    base = _alone(client, None, REQUESTS[0][2], REQUESTS[0][3])
    moved = max(
        abs(x - y)
        for s, t in zip(base["sequences"], got["a0"]["sequences"], strict=True)
        for x, y in zip(s["logprobs"], t["logprobs"], strict=False)
    )
    assert moved > 1e-3, moved


def test_one_shot_sampling_keeps_a_stack_per_snapshot(client: TrainerClient) -> None:
    """``sample(weights=...)`` alternating between two snapshots builds one one-slot stack
    each, then reuses them (CUDA graphs are keyed by the stack), with the same tokens."""
    before = client.sampler_weights_info().result()
    params = {"max_tokens": 6, "seed": 5, "num_samples": 2}
    runs = [_alone(client, w, [3, 17, 42], params) for w in ("a-snap", "b-snap") * 2]
    after = client.sampler_weights_info().result()
    assert after["uniform_builds"] - before["uniform_builds"] <= 2, (before, after)
    assert after["uniform_stacks"] >= 2, after
    assert runs[0] == runs[2] and runs[1] == runs[3]
    assert runs[0]["sequences"] != runs[1]["sequences"]  # the two adapters differ


def test_a_new_snapshot_refills_a_one_shot_stack_in_place(client: TrainerClient) -> None:
    """After a save (the store's version moves), a new snapshot's one-shot call takes a kept
    stack and writes it in place (an RL loop's new snapshot every step builds nothing), and
    samples as that snapshot's content does (the same tokens; log-probs within 1e-5):
    ``c-snap`` is run b's current adapters, i.e. ``b-snap`` (rank 2, no MLP adapters), written
    into a stack that held a's rank 4 with MLP adapters. A stale row of the old adapters, or
    the old slot scaling, changes the tokens."""
    params = {"max_tokens": 6, "seed": 5, "num_samples": 2}
    want_a = _alone(client, "a-snap", [3, 17, 42], params)
    want_b = _alone(client, "b-snap", [3, 17, 42], params)  # kept at the current version
    client.use_run("b").result()
    client.save_sampler_weights("c-snap").result()
    try:
        before = client.sampler_weights_info().result()
        got_c = _alone(client, "c-snap", [3, 17, 42], params)
        after = client.sampler_weights_info().result()
        assert after["uniform_builds"] == before["uniform_builds"], (before, after)
        assert after["uniform_refills"] == before["uniform_refills"] + 1, (before, after)
        _assert_same(want_b, got_c)  # tokens; log-probs within 1e-5 (a wider stack's sums)
        # b's own stack, filled at the old version: refilled
        _assert_same(want_b, _alone(client, "b-snap", [3, 17, 42], params))
        last = client.sampler_weights_info().result()
        assert last["uniform_builds"] == after["uniform_builds"], (after, last)
        assert last["uniform_refills"] == after["uniform_refills"] + 1, (after, last)
        # a's rank 4 fits neither kept stack now (c took a's): a new one, the same samples
        _assert_same(want_a, _alone(client, "a-snap", [3, 17, 42], params))
    finally:
        client.drop_sampler_weights("c-snap").result()


def test_the_active_runs_one_shot_sampling_rewrites_its_stack_at_every_call(
    client: TrainerClient,
) -> None:
    """``sample(weights=None)`` on a LoRA group: the active run's adapters written into a
    one-slot stack at every call (lean layers), so that switching runs between calls samples
    each one's adapters (a stack left as the last call's gives b's samples for a)."""
    params: dict[str, Any] = {"max_tokens": 6, "seed": 5, "num_samples": 2}
    want = {run: _alone(client, f"{run}-snap", [3, 17, 42], params) for run in ("b", "a")}
    before = client.sampler_weights_info().result()
    try:
        for run in ("b", "a"):  # each snapshot is its run's current adapters
            client.use_run(run).result()
            _assert_same(want[run], client.sample([[3, 17, 42]], **params).result()[0])
    finally:
        client.use_run("b").result()
    after = client.sampler_weights_info().result()
    written = after["uniform_builds"] + after["uniform_refills"]
    assert written - before["uniform_builds"] - before["uniform_refills"] == 2, (before, after)
    # the live calls left the snapshots' current stacks alone: sampling them again writes none
    for run in ("b", "a"):
        _assert_same(want[run], _alone(client, f"{run}-snap", [3, 17, 42], params))
    last = client.sampler_weights_info().result()
    assert last["uniform_builds"] + last["uniform_refills"] == written, (after, last)


def test_sampled_logprobs_equal_compute_log_prob_under_the_adapter(
    client: TrainerClient,
) -> None:
    prompts = {"a": [3, 17, 42, 5, 9], "b": [100, 2, 8], "default": [7, 7, 8, 1]}
    weights = {"a": "a-snap", "b": "b-snap", "default": None}  # default's B is 0: the base
    got: dict[str, Any] = {}
    for run, prompt in prompts.items():
        request = _request(run, weights[run], prompt, {"max_tokens": 10, "seed": 7})
        got.update(client.sample_step([request], max_steps=3).result()["finished"])
    _drain(client, got)
    for run, prompt in prompts.items():
        client.use_run(run).result()
        tokens = got[run]["sequences"][0]["tokens"]
        seq = torch.tensor([prompt + tokens])
        batch = (
            client.compute_log_prob({"input_ids": seq, "attention_mask": torch.ones_like(seq)})
            .result()
            .batch
        )
        assert batch is not None
        want = batch["log_probs"][0, len(prompt) - 1 :].float()
        have = torch.tensor(got[run]["sequences"][0]["logprobs"])
        torch.testing.assert_close(have, want, atol=1e-4, rtol=0)
    client.use_run("b").result()


def test_an_unknown_adapter_fails_alone_and_the_group_stays_usable(
    client: TrainerClient,
) -> None:
    probe = {"input_ids": fixed_batch(seed=6)}
    before = client.compute_log_prob(probe).result().batch
    params = {"max_tokens": 6, "seed": 4}
    got: dict[str, Any] = {}
    out = client.sample_step([_request("ok", "a-snap", [1, 2], params)], max_steps=2).result()
    got.update(out["finished"])
    admit = [
        _request("nope", "nope", [1, 2], params),
        _request("empty", "", [1, 2], params),
        _request("late", "b-snap", [3, 4], params),
    ]
    out = client.sample_step(admit, max_steps=2).result()
    assert set(out["failed"]) == {"nope", "empty"}
    assert "no sampler weights named 'nope'" in out["failed"]["nope"]
    assert "weights must be a snapshot name" in out["failed"]["empty"]
    got.update(out["finished"])
    # between chunks the active run's hooks are back: its function, bit for bit
    between = client.compute_log_prob(probe).result().batch
    _drain(client, got)
    assert before is not None and between is not None
    assert torch.equal(between["log_probs"], before["log_probs"])
    assert set(got) == {"ok", "late"}
    _assert_same(_alone(client, "a-snap", [1, 2], params), got["ok"])
    _assert_same(_alone(client, "b-snap", [3, 4], params), got["late"])
    after = client.compute_log_prob(probe).result().batch
    assert after is not None and torch.equal(after["log_probs"], before["log_probs"])


def test_a_new_snapshot_takes_the_old_ones_slot_in_place(client: TrainerClient) -> None:
    """An RL loop's next snapshot: the stack (a and b, two slots) is refilled in place with
    it, not rebuilt (on a GPU the captured graphs stay valid), and it samples as alone."""
    _drain(client, {})
    start = client.sample_step([], max_steps=1).result()
    client.use_run("a").result()
    client.forward_backward({"input_ids": fixed_batch(3)}).result()
    client.optim_step(lr=LR).result()
    client.save_sampler_weights("a-next").result()
    client.use_run("b").result()
    params = {"max_tokens": 8, "seed": 11, "num_samples": 2}
    got: dict[str, Any] = {}
    out = client.sample_step([_request("next", "a-next", [5, 6, 7], params)], max_steps=2).result()
    got.update(out["finished"])
    last = _drain(client, got)
    assert last["adapters"] == 1
    assert last["adapter_refills"] == start["adapter_refills"] + 1
    assert last["adapter_rebuilds"] == start["adapter_rebuilds"]
    _assert_same(_alone(client, "a-next", [5, 6, 7], params), got["next"])
    old = _alone(client, "a-snap", [5, 6, 7], params)  # the refill wrote the new values
    assert old["sequences"][0]["logprobs"] != got["next"]["sequences"][0]["logprobs"]
    # a and b together again: two sets in two slots, in place as well
    both = [
        _request("a", "a-snap", [1, 2, 3], {"max_tokens": 5, "seed": 1}),
        _request("b", "b-snap", [4, 5], {"max_tokens": 5, "seed": 2}),
    ]
    got.update(client.sample_step(both, max_steps=2).result()["finished"])
    last = _drain(client, got)
    assert last["adapters"] == 2 and last["adapter_rebuilds"] == start["adapter_rebuilds"]
    _assert_same(_alone(client, "a-snap", [1, 2, 3], {"max_tokens": 5, "seed": 1}), got["a"])
    _assert_same(_alone(client, "b-snap", [4, 5], {"max_tokens": 5, "seed": 2}), got["b"])


class _Backend:
    """What ``SampleQueue`` uses of the service's ``Backend``: the client and ``wait``."""

    def __init__(self, client: TrainerClient) -> None:
        self.client = client

    async def wait(self, future: Any) -> Any:
        return await asyncio.to_thread(future.result, 120)


def test_the_service_queue_sends_lora_requests_to_the_engine(client: TrainerClient) -> None:
    from tgruntime.service.sampling import SampleJob, SampleQueue
    from tgruntime.trainer.logprob_options import LogprobOptions

    cases = [("a-snap", [4, 5, 6], 20), ("b-snap", [8, 9], 4), (None, [2, 3], 4)]

    async def main() -> tuple[dict[int, Any], SampleQueue]:
        queue = SampleQueue(_Backend(client), multi_lora=True, continuous=True)  # type: ignore[arg-type]
        assert queue.continuous is not None
        sched = queue.continuous
        sched.steps = sched.steps_busy = sched.steps_max = 2  # short chunks: room to join
        queue.start()
        results: dict[int, Any] = {}

        def put(i: int) -> None:
            weights, prompt, max_tokens = cases[i]
            key = (weights, max_tokens, 1.0, -1, 1.0, 30 + i, None, 1, False, LogprobOptions())

            def done(result: dict[str, Any] | None, exc: BaseException | None) -> None:
                results[i] = exc if exc is not None else result

            queue.put(SampleJob(key, prompt, done))

        put(0)
        while queue.continuous.calls < 2:  # the long one decodes; the others join it
            await asyncio.sleep(0.01)
        put(1)
        put(2)
        for _ in range(6000):
            await asyncio.sleep(0.02)
            if len(results) == len(cases):
                break
        await queue.stop()
        return results, queue

    results, queue = asyncio.run(main())
    assert queue.continuous is not None and queue.continuous.overflowed == 0
    long = results[0]["engine"]
    for i, (weights, prompt, max_tokens) in enumerate(cases):
        assert not isinstance(results[i], BaseException), results[i]
        if i:
            assert long["admitted_step"] < results[i]["engine"]["admitted_step"]
            assert results[i]["engine"]["admitted_step"] < long["finished_step"]
        params = {"max_tokens": max_tokens, "seed": 30 + i}
        _assert_same(_alone(client, weights, prompt, params), results[i])


def test_continuous_batching_off_sends_lora_requests_one_shot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tgruntime.service.sampling import SampleQueue

    backend: Any = object()
    assert SampleQueue(backend, multi_lora=True).continuous is not None  # the default: on
    monkeypatch.setenv("TG_CONTINUOUS_BATCHING", "0")
    assert SampleQueue(backend, multi_lora=True).continuous is None


# -- GPU: CUDA graphs over the per-row adapters, the stack rebuilt mid-decode ------------------
def gpu_continuous_lora(gpu: bool = True) -> dict[str, Any]:
    """One GPU, bf16, TP=1, pieces driven directly (no Ray on the device): two runs trained
    at a high lr and snapshotted; the same arrivals (a, the base, then b while they decode:
    a stack rebuild mid-decode, then a again) served by the engine with CUDA graphs and
    without; and each request alone through the one-shot sampler under its own hooks.
    ``gpu=False``: the same on the CPU without graphs (a check of this script itself)."""
    from tests.trainer.scenarios import _quiet

    _quiet()
    import tgapi
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.lora import LoraSettings
    from tgruntime.trainer.lora.runs import RunSet
    from tgruntime.trainer.sampling.continuous import RowAdapters, SlotEngine
    from tgruntime.trainer.sampling.decoder import unwrap_gpt
    from tgruntime.trainer.sampling.generate import Sampler
    from tgruntime.trainer.sampling.params import SamplingParams
    from tgruntime.trainer.sampling.pool import PoolSize
    from tgruntime.trainer.sampling.snapshots import AdapterSnapshotStore
    from tgruntime.trainer.sampling.uniform import UniformStacks
    from tgruntime.trainer.settings import resolve_settings

    vocab = 512
    spec = tgapi.parse_spec(
        {
            "workers": {"useGpu": gpu, "processesPerNode": [1]},
            "model": {
                "vocabSize": vocab,
                "hiddenSize": 512,
                "numLayers": 4,
                "numAttentionHeads": 8,
                "numQueryGroups": 4,
                "ffnHiddenSize": 1408,
                "maxSequenceLength": 128,
                "positionEmbedding": "rope",
            },
            "optimizer": {"lr": 2e-2},
            "training": {"batchSize": 8, "sequenceLength": 128},
        },
        local=True,
    )
    init_process_group(resolve_settings(spec))
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, vocab, (8, 128), generator=gen) for _ in range(2)]
    engine = TrainEngine.create(spec=spec, lora=LoraSettings(rank=16, alpha=32.0))
    out: dict[str, Any] = {}
    try:
        module = engine.state.module
        runs, store = RunSet(engine), AdapterSnapshotStore()
        for run, settings in (
            ("a", LoraSettings(rank=16, alpha=32.0, seed=1)),
            ("b", LoraSettings(rank=8, alpha=16.0, seed=2, train_mlp=False)),
        ):
            runs.create(run, settings)
            for d in data:
                engine.train_step(d)
            assert engine.adapters is not None
            store.save(
                run, engine.adapters, run=run, base=engine.base_fingerprint(), mesh=engine.mesh_info
            )
        runs.use("a")  # a's next snapshot, as an RL loop saves one every step
        engine.train_step(data[0])
        assert engine.adapters is not None
        store.save(
            "a2", engine.adapters, run="a", base=engine.base_fingerprint(), mesh=engine.mesh_info
        )
        gpt, shape = unwrap_gpt(module), engine.adapters.shape
        sets: dict[str | None, Any] = {None: None}
        for run in ("a", "b", "a2"):
            snap = store.resolve(run, mesh=engine.mesh_info, base="", device=engine.device)
            sets[run] = store.adapters_for(snap, gpt, shape)
        engine.adapters.detach()  # the active run's hooks off: the engine's stack only
        prompts = [
            torch.randint(0, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(8, 32, (4,), generator=gen)
        ]
        arrivals = [  # (id, adapter, prompt, params, steps run after it arrives)
            ("a0", "a", prompts[0], SamplingParams(max_tokens=48, seed=1, num_samples=3), 6),
            ("base0", None, prompts[1], SamplingParams(max_tokens=24, seed=2), 6),
            ("b0", "b", prompts[2], SamplingParams(max_tokens=32, seed=3, num_samples=2), 6),
            ("a1", "a", prompts[3], SamplingParams(max_tokens=16, seed=4, temperature=0.0), 6),
        ]
        # after the first ones drain, a's next snapshot alone: it takes a slot of the stack
        # in place (a refill), and the graphs captured before serve it
        later = [("a2_0", "a2", prompts[0], SamplingParams(max_tokens=24, seed=5, num_samples=2))]
        sampler = Sampler(module, cuda_graphs=False)

        def serve(graphs: bool) -> tuple[dict[str, Any], dict[str, Any]]:
            size = PoolSize(slots=16, length=128, row_bytes=0, budget=None)
            lora = RowAdapters(gpt, size.slots)
            slot_engine = SlotEngine(sampler.decoder, size, cuda_graphs=graphs, lora=lora)
            got: dict[str, Any] = {}
            with lora.attached():
                for rid, run, prompt, params, steps in arrivals:
                    slot_engine.submit(rid, prompt, params, sets[run])
                    got.update(slot_engine.run(steps))
                while slot_engine.busy:
                    got.update(slot_engine.run(8))
                before = slot_engine.info()
                for rid, run, prompt, params in later:
                    slot_engine.submit(rid, prompt, params, sets[run])
                while slot_engine.busy:
                    got.update(slot_engine.run(8))
            return got, {**slot_engine.info(), "before_refill": before}

        graphed, out["graphed_info"] = serve(gpu)
        eager, out["eager_info"] = serve(False)

        # the warm-up's capture: every bucket's graph over a stack of the active run's
        # adapters (a), before any request; a's next snapshot then refills it in place
        size = PoolSize(slots=16, length=128, row_bytes=0, budget=None)
        lora = RowAdapters(gpt, size.slots)
        warmed = SlotEngine(sampler.decoder, size, cuda_graphs=gpu, lora=lora)
        prewarmed: dict[str, Any] = {}
        with lora.attached():
            out["captured"] = warmed.capture_buckets(sets["a"])
            out["after_capture"] = warmed.info()
            for rid, run, prompt, params in later:
                warmed.submit(rid, prompt, params, sets[run])
            while warmed.busy:
                prewarmed.update(warmed.run(8))
        out["prewarmed_info"] = warmed.info()
        out["prewarmed_equals_eager"] = [
            s["tokens"] == e["tokens"]
            for rid, *_ in later
            for s, e in zip(prewarmed[rid]["sequences"], eager[rid]["sequences"], strict=True)
        ]
        alone: dict[str, Any] = {}
        for rid, name, prompt, params in [a[:4] for a in arrivals] + later:
            hooks = sets[name]
            if hooks is not None:
                hooks.attach()
            try:
                (alone[rid],) = sampler.generate([prompt], params)
            finally:
                if hooks is not None:
                    hooks.detach()

        # one-shot calls through one-slot stacks with a uniform row map (the service's
        # sample(weights=snapshot) path), graphed where allowed; a new store version at every
        # call, so each after the first refills a kept stack in place (b's rank 8 without
        # MLP adapters into a's rank 16 stack, then a again, then a2)
        stacks, one_shot = UniformStacks(), Sampler(module, cuda_graphs=gpu)
        uniform: dict[str, Any] = {}
        adapted = [a[:4] for a in arrivals if a[1] is not None] + later
        for version, (rid, name, prompt, params) in enumerate(adapted):
            assert name is not None
            multi = stacks.get(gpt, name, version, sets[name])
            multi.attach()
            try:
                (uniform[rid],) = one_shot.generate([prompt], params, hooks=multi)
            finally:
                multi.detach()
        out["uniform_path"] = one_shot.decoder.last_path
        out["uniform_stacks"] = {"builds": stacks.builds, "refills": stacks.refills}
        out["uniform_graphs"] = len(one_shot._graphs)
        out["uniform_equals_alone"] = [
            s["tokens"] == t["tokens"]
            for rid, *_ in adapted
            for s, t in zip(uniform[rid]["sequences"], alone[rid]["sequences"], strict=True)
        ]
        out["uniform_first_lp_diff"] = max(
            abs(uniform[r]["sequences"][0]["logprobs"][0] - alone[r]["sequences"][0]["logprobs"][0])
            for r, *_ in adapted
        )

        def rows(results: dict[str, Any]) -> list[list[int]]:
            ids = [r for r, *_ in arrivals] + [r for r, *_ in later]
            return [s["tokens"] for r in ids for s in results[r]["sequences"]]

        out["graphed_equals_eager"] = [
            x == y for x, y in zip(rows(graphed), rows(eager), strict=True)
        ]
        out["eager_equals_alone"] = [x == y for x, y in zip(rows(eager), rows(alone), strict=True)]
        out["first_lp_diff"] = max(
            abs(graphed[r]["sequences"][0]["logprobs"][0] - alone[r]["sequences"][0]["logprobs"][0])
            for r, *_ in arrivals
        )
        out["joined"] = all(
            graphed[r]["engine"]["admitted_step"] < graphed["a0"]["engine"]["finished_step"]
            for r, *_ in arrivals
        )
        return out
    finally:
        engine.shutdown()
        torch.distributed.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
def test_gpu_graphs_over_per_row_adapters_survive_a_stack_rebuild() -> None:
    import json

    from tgruntime.trainer.launch import launch

    (r,) = launch(gpu_continuous_lora, world_size=1, timeout_s=600)
    print("\n", json.dumps(r, indent=1, default=str))
    assert r["joined"]
    info, before = r["graphed_info"], r["graphed_info"]["before_refill"]
    assert info["graphs"] > 0 and before["adapter_rebuilds"] >= 2
    # a's next snapshot was written into the stack in place: no rebuild, no graph dropped
    assert info["adapter_refills"] == before["adapter_refills"] + 1
    assert info["adapter_rebuilds"] == before["adapter_rebuilds"]
    assert info["graphs"] >= before["graphs"]
    # bf16: the graphed step is the eager step's kernels over the whole slot length, and the
    # one-shot sampler batches other rows; a wrong adapter (a stale stack, a wrong row map)
    # changes nearly every row
    assert sum(r["graphed_equals_eager"]) >= len(r["graphed_equals_eager"]) - 1, r
    assert sum(r["eager_equals_alone"]) >= len(r["eager_equals_alone"]) - 2, r
    assert r["first_lp_diff"] < 0.1
    # the warm-up's capture: one graph per bucket up to 16 slots (1, 2, 4, 8, 12, 16), then
    # the snapshot's requests refilled the stack and captured nothing more
    assert r["captured"] == 6 and r["after_capture"]["graphs"] == 6, r
    warmed = r["prewarmed_info"]
    assert warmed["graphs"] == 6 and warmed["adapter_rebuilds"] == 1, warmed
    assert warmed["adapter_refills"] == 1, warmed
    assert all(r["prewarmed_equals_eager"]), r
    # one-shot through one-slot stacks (uniform map): the lean step with the deltas, one
    # stack built and refilled for b, a and a2, the same samples as each under its own hooks
    assert r["uniform_path"] == "lean+lora", r
    assert r["uniform_stacks"] == {"builds": 1, "refills": 3}, r
    assert r["uniform_graphs"] > 0, r
    assert sum(r["uniform_equals_alone"]) >= len(r["uniform_equals_alone"]) - 1, r
    assert r["uniform_first_lp_diff"] < 0.1, r
