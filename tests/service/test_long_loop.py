"""A long training loop through the unmodified SDK leaves the server's registries and the
group's resident sampler weights bounded (TP=2 group, CPU, gloo).

A few hundred ``forward_backward`` + ``optim_step`` steps, with a
``save_weights_and_get_sampling_client`` + ``sample`` every ``SAVE_EVERY`` steps, as an RL
loop makes them. At each save: the worker's sampler copies (``sampler_weights_info``: names
and bytes), the server's stores (futures pending and held, sessions, models, sampling
sessions, ephemeral copies) are recorded; the tests assert on those records."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tests.service.test_sdk_flow import WAIT, _batch, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
STEPS = 500
SAVE_EVERY = 25


def _held_bytes(futures: Any) -> int:
    """The payload bytes the server's future store holds for finished requests."""
    total = 0
    for entry in list(futures._entries.values()):
        out = entry.outcome
        if out is not None and out.proto is not None:
            total += len(out.proto)
    return total


@pytest.fixture(scope="module")
def long_loop(served: dict[str, Any]) -> dict[str, Any]:
    group, service = served["client"], served["service"]
    prompt = T.ModelInput.from_ints([5, 6, 7])
    params = T.SamplingParams(max_tokens=4, temperature=1.0, seed=11, stop=[])
    adam = T.AdamParams(learning_rate=1e-3)
    data = _batch(7, n=2, length=12)
    losses: list[float] = []
    checks: list[dict[str, Any]] = []
    started, cpu0 = time.monotonic(), time.process_time()
    # other tests' sessions and models on the package's shared server are not this loop's
    before = service.registry
    old_sessions, old_models = set(before.sessions), set(before.models)
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result(
            timeout=WAIT
        )
        for step in range(1, STEPS + 1):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(adam)
            losses.append(fb.result(timeout=WAIT).metrics["loss:sum"])
            opt.result(timeout=WAIT)
            if step % SAVE_EVERY:
                continue
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
            out = sampler.sample(prompt, num_samples=2, sampling_params=params).result(
                timeout=WAIT
            )
            assert len(out.sequences) == 2 and all(len(s.tokens) == 4 for s in out.sequences)
            info = group.sampler_weights_info().result(timeout=WAIT)
            reg = service.registry
            checks.append({
                "step": step,
                "worker_names": sorted(info["names"]),
                "worker_bytes": info["bytes"],
                "ephemeral_resident": service.ephemeral.resident(),
                "futures_pending": service.futures.pending(),
                "futures_held": len(service.futures),
                "futures_bytes": _held_bytes(service.futures),
                "sessions": sum(
                    1 for k, s in reg.sessions.items() if k not in old_sessions and reg.alive(s)
                ),
                "models": sum(
                    1 for k, m in reg.models.items() if k not in old_models and m.retired is None
                ),
                "samplers": len(reg.samplers),
                "tasks": len(service._tasks),
            })
        model_id = tc.model_id
    return {
        "losses": losses,
        "checks": checks,
        "model_id": model_id,
        "wall_s": time.monotonic() - started,
        "cpu_s": time.process_time() - cpu0,
    }


def test_long_loop_losses_finite_and_worker_copies_bounded(long_loop: dict[str, Any]) -> None:
    losses, checks = long_loop["losses"], long_loop["checks"]
    print(f"{STEPS} steps: {long_loop['wall_s']:.1f} s wall, {long_loop['cpu_s']:.1f} s CPU "
          f"(this process); last check {checks[-1]}")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], (losses[0], losses[-1])
    assert len(checks) == STEPS // SAVE_EVERY
    mid = long_loop["model_id"]
    others0: set[str] = set()
    for i, c in enumerate(checks):
        # the worker holds one ephemeral copy of this model: its newest (its i-th save).
        # Copies of other servers over the same shared group (the package's gateway fixture
        # runs two; this server's eviction does not own theirs) may stay, but never grow
        eph = [n for n in c["worker_names"] if "/ephemeral/" in n]
        assert [n for n in eph if n.startswith(f"{mid}/")] == [f"{mid}/ephemeral/{i}"], c
        others = {n for n in eph if not n.startswith(f"{mid}/")}
        others0 = others if i == 0 else others0
        assert others <= others0, c
        assert c["ephemeral_resident"] == 1, c
        # nothing left pending between steps; background tasks (drops) do not pile up
        assert c["futures_pending"] == 0, c
        assert c["tasks"] <= 4, c
        # one live session and one trained model however long the run
        assert c["sessions"] == 1 and c["models"] == 1, c
    first, last = checks[0], checks[-1]
    assert len(last["worker_names"]) == len(first["worker_names"]), (first, last)
    assert last["worker_bytes"] == first["worker_bytes"], (first, last)
    # one sampling session per save (none leaked besides), a record of a few hundred bytes
    assert last["samplers"] - first["samplers"] == len(checks) - 1, (first, last)


def test_long_loop_future_store_bounded(long_loop: dict[str, Any]) -> None:
    """Fetched results are kept for a retried fetch only among each owner's newest
    (service/futures.py), so the store does not grow with the steps, at any pace."""
    checks = long_loop["checks"]
    first, last = checks[0], checks[-1]
    assert max(c["futures_held"] for c in checks) <= first["futures_held"] + 2 * SAVE_EVERY
    assert last["futures_held"] <= first["futures_held"] + 2 * SAVE_EVERY, (first, last)
    assert last["futures_bytes"] <= 2 * max(first["futures_bytes"], 1), (first, last)
