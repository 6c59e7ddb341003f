"""The unmodified tinker SDK against a LoRA group (``spec.lora``): many runs on one base.

A TP=2 group (CPU, gloo) with ``spec.lora`` and ``spec.api.maxRuns: 3``; each
``create_lora_training_client`` is a run of its own on the workers. Checked here: runs of
rank 8 and rank 32 train side by side, each following its curve alone bit for bit; save_state
then create_training_client_from_state continues a run; the run limit; fair turns under a
flood of one run's requests; an idle run parked and brought back; bad ranks refused with
nothing left behind."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures_ray import RayCluster
from tests.service.conftest import MODEL, serving
from tests.service.test_bad_inputs import create_model_refused

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
WAIT = 300.0
VOCAB = 128
ADAM = T.AdamParams(learning_rate=5e-3)


@pytest.fixture(scope="module")
def lora_served(
    service_driver: RayCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    import tgapi
    from tests.trainer.scenarios import tiny_spec

    root = tmp_path_factory.mktemp("tinker-lora")
    wire = tgapi.to_wire(tiny_spec(tp=2, checkpoint_dir=str(root / "ckpt"), **MODEL))  # type: ignore[arg-type]
    wire["lora"] = {"rank": 32, "alpha": 16}
    wire["api"] = {**wire.get("api", {}), "maxRuns": 3, "idleRunSeconds": 0}
    spec = tgapi.parse_spec(wire, local=True)
    with serving(spec, root, prefix="svc-lora") as s:
        yield s


def _sc(served: dict[str, Any]) -> Any:
    return tinker.ServiceClient(base_url=served["url"], api_key=served["key"])


def _batch(seed: int, n: int = 2, length: int = 17) -> list[Any]:
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks = [int(t) for t in g.integers(2, VOCAB, size=length - i * 3)]
        out.append(
            T.Datum(
                model_input=T.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray(toks[1:], np.int64),
                    "weights": np.ones(len(toks) - 1, np.float32),
                },
            )
        )
    return out


def _steps(tc: Any, seeds: list[int]) -> list[float]:
    losses = []
    for s in seeds:
        fb = tc.forward_backward(_batch(s), "cross_entropy").result(timeout=WAIT)
        tc.optim_step(ADAM).result(timeout=WAIT)
        losses.append(fb.metrics["loss:sum"])
    return losses


def _runs(served: dict[str, Any]) -> dict[str, Any]:
    lora = served["service"].lora
    return dict(lora.runs)


def _until_no_runs(served: dict[str, Any], timeout_s: float = 60.0) -> None:
    """A finished session's runs are dropped in the background: wait (bounded) for it."""
    deadline = time.monotonic() + timeout_s
    while _runs(served):
        assert time.monotonic() < deadline, f"runs left after the session: {_runs(served)}"
        time.sleep(0.2)


def test_rank_8_and_32_runs_side_by_side_follow_their_curves_alone(
    lora_served: dict[str, Any],
) -> None:
    base = lora_served["base"]
    with _sc(lora_served) as sc:
        solo8 = sc.create_lora_training_client(base_model=base, rank=8, seed=1).result()
        alone8 = _steps(solo8, [0, 0, 0])
        solo32 = sc.create_lora_training_client(base_model=base, rank=32, seed=2).result()
        alone32 = _steps(solo32, [3, 3, 3])
    _until_no_runs(lora_served)  # the session finished: its runs are dropped
    with _sc(lora_served) as sc:
        tc8 = sc.create_lora_training_client(base_model=base, rank=8, seed=1).result()
        tc32 = sc.create_lora_training_client(base_model=base, rank=32, seed=2).result()
        info = tc8.get_info()
        assert info.is_lora and info.lora_rank == 8
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            f8 = pool.submit(_steps, tc8, [0, 0, 0])
            f32 = pool.submit(_steps, tc32, [3, 3, 3])
            together8, together32 = f8.result(), f32.result()
        runs = _runs(lora_served)
        assert {r.rank for r in runs.values()} == {8, 32}
        assert all(r.steps == 3 for r in runs.values())
    assert together8 == alone8
    assert together32 == alone32
    assert alone8[-1] < alone8[0] and alone32[-1] < alone32[0]  # one batch, again: it learns


def test_save_state_then_a_new_client_from_it_continues_the_run(
    lora_served: dict[str, Any],
) -> None:
    base = lora_served["base"]
    with _sc(lora_served) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=8, seed=3).result()
        _steps(tc, [0, 1])
        path = tc.save_state("two").result(timeout=WAIT).path
        saved = Path(lora_served["root"]) / "ckpt" / "tinker"
        files = sorted(p.name for p in saved.rglob("*") if p.is_file() and "weights" in str(p))
        assert "lora.json" in files and not any(f.startswith("shard_") for f in files), files
        want = _steps(tc, [2])
        tc2 = sc.create_training_client_from_state_with_optimizer(path).result()
        assert tc2.get_info().lora_rank == 8
        assert _steps(tc2, [2]) == want
        # weights only: the same loss (the adapters), another update afterwards
        tc3 = sc.create_training_client_from_state(path).result()
        fb = tc3.forward_backward(_batch(2), "cross_entropy").result(timeout=WAIT)
        assert fb.metrics["loss:sum"] == want[0]


def test_the_run_limit_is_refused_clearly_and_frees_with_the_session(
    lora_served: dict[str, Any],
) -> None:
    base = lora_served["base"]
    with _sc(lora_served) as sc:
        held = [sc.create_lora_training_client(base_model=base, rank=4).result() for _ in range(3)]
        with pytest.raises(Exception, match="maxRuns 3"):
            sc.create_lora_training_client(base_model=base, rank=4).result()
        assert len(_runs(lora_served)) == 3
        assert held
    _until_no_runs(lora_served)  # the first session finished: its runs are gone
    with _sc(lora_served) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4).result()
        assert _steps(tc, [0])


def test_the_run_limit_fails_the_create_model_future_not_http_429(
    lora_served: dict[str, Any],
) -> None:
    base = lora_served["base"]
    with _sc(lora_served) as sc:
        held = [sc.create_lora_training_client(base_model=base, rank=4).result() for _ in range(3)]
        create_model_refused(
            lora_served, r"its limit \(spec\.api\.maxRuns 3\)", r"raise spec\.api\.maxRuns"
        )
        assert set(_runs(lora_served)) == {tc.model_id for tc in held}
    _until_no_runs(lora_served)


def _until(ok: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.02)


def test_a_flooding_run_does_not_starve_another(lora_served: dict[str, Any]) -> None:
    base = lora_served["base"]
    turns = lora_served["service"].lora.turns
    with _sc(lora_served) as sc:
        busy = sc.create_lora_training_client(base_model=base, rank=4, seed=5).result()
        calm = sc.create_lora_training_client(base_model=base, rank=4, seed=6).result()
        # The order is made, not raced: the test holds the one turn while the flood and then
        # calm's calls queue (a 0.5 s sleep was too little at load 12), then lets go. A run's
        # calls take turns in seq_id order, so each run has one call waiting at a time.
        let_go = threading.Event()

        async def hold() -> None:
            async with turns.turn("gate"):
                while not let_go.is_set():
                    await asyncio.sleep(0.02)

        held = lora_served["running"].submit(hold())
        _until(lambda: turns.granted[-1:] == ["gate"], "the test's turn")
        flood = [busy.forward_backward(_batch(i), "cross_entropy") for i in range(12)]
        _until(lambda: turns.waiting(busy.model_id) == 1, "the flood's first call queued")
        mine = [calm.forward_backward(_batch(100 + i), "cross_entropy") for i in range(3)]
        _until(lambda: turns.waiting(calm.model_id) == 1, "calm's first call queued")
        start = len(turns.granted)
        let_go.set()
        held.result(timeout=WAIT)
        for f in mine:
            f.result(timeout=WAIT)
        for f in flood:
            f.result(timeout=WAIT)
        ids = {busy.model_id: "busy", calm.model_id: "calm"}
        names = [ids.get(r, "other") for r in turns.granted[start:]]
        calm_at = [i for i, n in enumerate(names) if n == "calm"]
        assert len(calm_at) == 3, names
        # calm's calls were served one per cycle as soon as they came, not after the flood:
        # at most one busy call between two of calm's, and the flood went on afterwards
        assert calm_at[0] <= 3, names
        assert all(b - a <= 2 for a, b in itertools.pairwise(calm_at)), names
        assert "busy" in names[calm_at[-1] :], names


def test_an_idle_run_is_parked_and_comes_back(lora_served: dict[str, Any]) -> None:
    base = lora_served["base"]
    lora = lora_served["service"].lora
    with _sc(lora_served) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=8, seed=7).result()
        fresh = sc.create_lora_training_client(base_model=base, rank=8, seed=7).result()
        _steps(tc, [0])
        want = tc.forward(_batch(1), "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        untrained = fresh.forward(_batch(1), "cross_entropy").result(timeout=WAIT)
        assert untrained.metrics["loss:sum"] != pytest.approx(want, rel=1e-6)
        lora.idle_run_s = 1.0
        try:
            deadline = time.monotonic() + 60
            while not lora.runs[tc.model_id].parked:
                assert time.monotonic() < deadline, "the idle run was not parked within 60 s"
                time.sleep(0.5)
        finally:
            lora.idle_run_s = 0.0
        parked = Path(lora_served["root"]) / "ckpt" / "tinker" / "principals" / "default"
        parked = parked / tc.model_id / "parked"
        assert any(parked.glob("run_tp*_pp*.pt"))
        # back from disk with its trained adapter (a lost state would give the fresh run's loss)
        assert _steps(tc, [1])[0] == pytest.approx(want, rel=1e-6)
        assert not lora.runs[tc.model_id].parked


def test_bad_ranks_are_refused_and_leave_nothing(lora_served: dict[str, Any]) -> None:
    base = lora_served["base"]
    client = lora_served["client"]
    _until_no_runs(lora_served)
    with _sc(lora_served) as sc:
        before = [r["id"] for r in client.list_runs().result(timeout=WAIT)]
        with pytest.raises(Exception, match="rank"):
            sc.create_lora_training_client(base_model=base, rank=65).result()  # hidden 64
        with pytest.raises(Exception, match="rank"):
            sc.create_lora_training_client(base_model=base, rank=0).result()
        assert not _runs(lora_served)
        assert [r["id"] for r in client.list_runs().result(timeout=WAIT)] == before
        tc = sc.create_lora_training_client(base_model=base, rank=4).result()
        assert _steps(tc, [0])


def _seqs(future: Any) -> list[tuple[list[int], list[float]]]:
    return [(list(s.tokens), list(s.logprobs)) for s in future.result(timeout=WAIT).sequences]


def _differ(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> bool:
    """Other tokens, or the same tokens with log-probs apart by more than 1e-3."""
    if [t for t, _ in a] != [t for t, _ in b]:
        return True
    pairs = zip(a, b, strict=True)
    return max(abs(x - y) for (_, la), (_, lb) in pairs for x, y in zip(la, lb, strict=True)) > 1e-3


def test_sampling_from_runs_and_base_in_one_batch(lora_served: dict[str, Any]) -> None:
    """save_weights_for_sampler snapshots a run's adapter; its samples' logprobs equal
    compute_logprobs under it; requests for two runs' adapters and the base arriving together
    go to the workers' continuous engine in one call (one multi-LoRA batch) and give what each
    gives alone."""
    base = lora_served["base"]
    queue = lora_served["service"].samples
    prompt = T.ModelInput.from_ints([5, 6, 7, 8])
    params = T.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    with _sc(lora_served) as sc:
        tc8 = sc.create_lora_training_client(base_model=base, rank=8, seed=8).result()
        tc32 = sc.create_lora_training_client(base_model=base, rank=32, seed=9).result()
        for tc in (tc8, tc32):  # a high learning rate: the adapters move the distribution
            for _ in range(3):
                tc.forward_backward(_batch(0), "cross_entropy").result(timeout=WAIT)
                tc.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=WAIT)
        path = tc8.save_weights_for_sampler("s8").result(timeout=WAIT).path
        s8 = sc.create_sampling_client(model_path=path)
        s32 = tc32.save_weights_and_get_sampling_client()
        sbase = sc.create_sampling_client(base_model=base)
        samplers = {"r8": s8, "r32": s32, "base": sbase}
        alone = {k: _seqs(v.sample(prompt, 2, params)) for k, v in samplers.items()}
        for seq in s8.sample(prompt, 2, params).result(timeout=WAIT).sequences:
            full = T.ModelInput.from_ints([5, 6, 7, 8, *seq.tokens])
            plp = s8.compute_logprobs(full).result(timeout=WAIT)
            np.testing.assert_allclose(plp[4:], seq.logprobs, atol=1e-4)
        # each adapter changes the samples (tokens, or at least their log-probs), so a sampler
        # that served one of them as the base, or as the other adapter, shows here and below
        for a, b in (("r8", "base"), ("r32", "base"), ("r8", "r32")):
            assert _differ(alone[a], alone[b]), (a, b, alone[a], alone[b])
        # the three requests below join one call: the continuous engine (the default) admits
        # them together, whatever their adapters
        sched = queue.continuous
        assert sched is not None
        admitted: list[list[Any]] = []
        step = sched.step

        async def recorded(admit: list[Any], k: int, w: str | None, reset: bool) -> Any:
            if admit:
                admitted.append([a.get("weights") for a in admit])
            return await step(admit, k, w, reset)

        sched.step, sched.gather_s, queue.gather_s = recorded, 0.5, 0.5
        try:
            futures = {k: v.sample(prompt, 2, params) for k, v in samplers.items()}
            together = {k: _seqs(f) for k, f in futures.items()}
        finally:
            sched.step, sched.gather_s, queue.gather_s = step, 0.002, 0.002
    assert {k: [t for t, _ in v] for k, v in together.items()} == {
        k: [t for t, _ in v] for k, v in alone.items()
    }
    for k in alone:
        for (_, lp_together), (_, lp_alone) in zip(together[k], alone[k], strict=True):
            np.testing.assert_allclose(lp_together, lp_alone, atol=1e-4)
    assert len(admitted) == 1 and len(set(admitted[0])) == 3, admitted  # one call, 3 weights
    assert sched.overflowed == 0


def test_inflight_clients_of_a_run_share_one_target_that_follows_it(
    lora_served: dict[str, Any],
) -> None:
    """kind="inflight" on a LoRA group: each save writes the run's adapters into the model's
    one target (one in-memory name per model, however many saves), and an older inflight
    client samples the run's newest saved adapters; another run's training on the group does
    not reach it."""
    base = lora_served["base"]
    group = lora_served["client"]
    prompt = T.ModelInput.from_ints([5, 6, 7, 8])
    params = T.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    with _sc(lora_served) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=8, seed=3).result()
        other = sc.create_lora_training_client(base_model=base, rank=8, seed=4).result()
        first = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=WAIT)
        was = _seqs(first.sample(prompt, 2, params))
        for _ in range(3):  # a high learning rate: the adapters move the distribution
            tc.forward_backward(_batch(0), "cross_entropy").result(timeout=WAIT)
            tc.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=WAIT)
        assert not _differ(was, _seqs(first.sample(prompt, 2, params)))  # not saved yet
        samplers = len(lora_served["service"].registry.samplers)
        for _ in range(5):
            newer = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=WAIT)
        # every inflight save of a model answers with its one sampling session
        assert len(lora_served["service"].registry.samplers) == samplers
        other.forward_backward(_batch(1), "cross_entropy").result(timeout=WAIT)
        other.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=WAIT)
        now = _seqs(first.sample(prompt, 2, params))
        saved = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
        snapshot = _seqs(saved.sample(prompt, 2, params))
        assert _differ(was, now), (was, now)
        for got in (now, _seqs(newer.sample(prompt, 2, params))):
            assert [t for t, _ in got] == [t for t, _ in snapshot]
            for (_, a), (_, b) in zip(got, snapshot, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
        names = group.sampler_weights_info().result(timeout=WAIT)["names"]
        mine = sorted(n for n in names if n.startswith(f"{tc.model_id}/"))
        # the snapshot's copy and the one inflight target, after six inflight saves
        assert len(mine) == 2 and f"{tc.model_id}/ephemeral/inflight" in mine, names
        assert not [n for n in names if n.startswith(f"{other.model_id}/")], names
