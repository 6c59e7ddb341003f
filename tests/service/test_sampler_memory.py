"""An RL loop's sampler weights through the unmodified SDK do not accumulate in the group.

save_weights_and_get_sampling_client keeps an in-memory copy of the weights on every rank;
the cookbook makes one per step. The copies a newer one supersedes are freed once nothing
samples from them (service/sampler_weights.py), so the group's resident copies stay at one
per model however long the run (TP=2 group, CPU, gloo). ``kind="inflight"`` clients make no
copy at all."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
WAIT = 300.0
CALLS = 200


def _datum(tokens: list[int]) -> Any:
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


def test_200_sampling_clients_keep_one_copy_resident(served: dict[str, Any]) -> None:
    group = served["client"]
    prompt = T.ModelInput.from_ints([5, 6, 7])
    params = T.SamplingParams(max_tokens=2, temperature=1.0, seed=3, stop=[])
    copies: list[list[str]] = []  # the in-memory ephemeral copies at each check
    held: list[int] = []  # every sampler weight's bytes at each check
    with tinker.ServiceClient(base_url=served["url"], api_key=served["key"]) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        first: Any = None
        for i in range(CALLS):
            if i % 50 == 49:  # the weights move now and then, as in a run
                tc.forward_backward([_datum([4, 9, 3, 7, 5])], "cross_entropy").result(
                    timeout=WAIT
                )
                tc.optim_step(T.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
            out = sampler.sample(prompt, num_samples=2, sampling_params=params).result(
                timeout=WAIT
            )
            assert len(out.sequences) == 2
            first = first or sampler
            if i % 20 == 19:
                info = group.sampler_weights_info().result(timeout=WAIT)
                copies.append([n for n in info["names"] if "/ephemeral/" in n])
                held.append(info["bytes"])
        # the first client's copy is gone: refused with what happened and what to do
        with pytest.raises(Exception, match="were freed: the same training client saved newer"):
            first.sample(prompt, num_samples=1, sampling_params=params).result(timeout=WAIT)
    # at every check: one ephemeral copy of this model, its newest, and no more bytes held
    # than at the first check. Copies of other servers over the same shared group (the gateway
    # test runs two; this server's eviction does not own theirs) may stay, but never grow.
    mine = [[n for n in c if n.startswith(f"{tc.model_id}/")] for c in copies]
    others = [sorted(set(c) - set(m)) for c, m in zip(copies, mine, strict=True)]
    assert all(len(m) == 1 for m in mine), copies
    assert mine[-1] == [f"{tc.model_id}/ephemeral/{CALLS - 1}"], copies[-1]
    assert all(set(o) <= set(others[0]) for o in others), others
    assert max(held) <= held[0], held
    assert served["service"].ephemeral.resident() == 1


def _seqs(sampler: Any, prompt: Any, params: Any) -> list[tuple[list[int], list[float]]]:
    out = sampler.sample(prompt, num_samples=2, sampling_params=params).result(timeout=WAIT)
    return [(list(s.tokens), list(s.logprobs)) for s in out.sequences]


def _same(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, la), (_, lb) in zip(a, b, strict=True):
        np.testing.assert_allclose(la, lb, atol=1e-5)


def test_inflight_sampling_clients_follow_the_training_weights_with_no_copy(
    served: dict[str, Any],
) -> None:
    """save_weights_and_get_sampling_client(kind="inflight") on a full-weight group: no copy
    of the weights (the group's sampler weights are as before, however many saves), and every
    inflight client of the model samples its current weights: after training steps, an older
    inflight client gives what a snapshot of the new weights gives, and not what it gave
    before."""
    group = served["client"]
    prompt = T.ModelInput.from_ints([5, 6, 7])
    params = T.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    with tinker.ServiceClient(base_url=served["url"], api_key=served["key"]) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        before = group.sampler_weights_info().result(timeout=WAIT)
        first = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=WAIT)
        was = _seqs(first, prompt, params)
        samplers = len(served["service"].registry.samplers)
        for _ in range(20):
            tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=WAIT)
        assert len(served["service"].registry.samplers) == samplers  # one session, reused
        after = group.sampler_weights_info().result(timeout=WAIT)
        assert (after["names"], after["bytes"]) == (before["names"], before["bytes"]), after
        for _ in range(2):  # a high learning rate: the distribution moves
            tc.forward_backward([_datum([4, 9, 3, 7, 5, 6])], "cross_entropy").result(
                timeout=WAIT
            )
            tc.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=WAIT)
        now = _seqs(first, prompt, params)
        newer = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=WAIT)
        snapshot = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
        _same(now, _seqs(snapshot, prompt, params))
        _same(now, _seqs(newer, prompt, params))
        moved = max(
            abs(x - y)
            for (_, la), (_, lb) in zip(was, now, strict=True)
            for x, y in zip(la, lb, strict=True)  # max_tokens each, no stop
        )
        assert moved > 1e-3, (was, now)


def test_named_saves_are_a_bounded_cache_read_back_from_disk(served: dict[str, Any]) -> None:
    """save_weights_for_sampler(name) writes the weights to disk; the group's in-memory copies
    of them are a cache inside the budget (spec.training.samplerWeightsMemory; least recently
    used out), not one full copy per save: after more named saves than the budget holds, the
    resident copies fit it, and the first one, evicted, samples again from its directory
    exactly as it did when it was saved."""
    group = served["client"]
    prompt = T.ModelInput.from_ints([5, 6, 7])
    params = T.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    info = group.sampler_weights_info().result(timeout=WAIT)
    copy = info["bytes"] // len(info["names"])  # every copy of a full-weight group: one size
    assert "samplerWeightsMemory 2Mi" in info["budget_source"], info
    saves = info["budget_bytes"] // copy + 3
    with tinker.ServiceClient(base_url=served["url"], api_key=served["key"]) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        paths: list[str] = []
        first: Any = None
        for i in range(saves):
            paths.append(tc.save_weights_for_sampler(f"cache-{i}").result(timeout=WAIT).path)
            if i == 0:
                first = _seqs(sc.create_sampling_client(model_path=paths[0]), prompt, params)
                tc.forward_backward([_datum([4, 9, 3, 7, 5, 6])], "cross_entropy").result(
                    timeout=WAIT
                )
                tc.optim_step(T.AdamParams(learning_rate=5e-2)).result(timeout=WAIT)
        info = group.sampler_weights_info().result(timeout=WAIT)
        mine = [n for n in info["names"] if "/cache-" in n]
        assert info["bytes"] <= info["budget_bytes"] and len(mine) < saves, info
        assert not any(n.endswith("/cache-0") for n in info["names"]), info  # evicted
        last = _seqs(sc.create_sampling_client(model_path=paths[-1]), prompt, params)
        again = _seqs(sc.create_sampling_client(model_path=paths[0]), prompt, params)
        _same(first, again)  # read back from its directory
        assert [t for t, _ in first] != [t for t, _ in last] or max(
            abs(x - y)
            for (_, la), (_, lb) in zip(first, last, strict=True)
            for x, y in zip(la, lb, strict=True)
        ) > 1e-3, (first, last)


def test_a_copy_over_the_budget_is_refused_naming_it_and_the_group_goes_on(
    served: dict[str, Any],
) -> None:
    """Copies only in memory fill the group's budget (spec.training.samplerWeightsMemory 2Mi):
    the group refuses the next one on both ranks alike (they agree on it: neither hangs in a
    barrier), an SDK save_weights_and_get_sampling_client then fails with the budget's name and
    its fixes, not an out-of-memory, and once the copies go the same call works again."""
    group = served["client"]
    prompt = T.ModelInput.from_ints([5, 6, 7])
    params = T.SamplingParams(max_tokens=2, temperature=1.0, seed=3, stop=[])
    pins: list[str] = []
    try:
        for i in range(64):  # the budget holds 11 copies of this model
            try:
                group.save_sampler_weights(f"pin-{i}", None).result(timeout=WAIT)
            except Exception as exc:
                assert "spec.training.samplerWeightsMemory" in str(exc), exc
                break
            pins.append(f"pin-{i}")
        else:
            pytest.fail("64 in-memory copies fit a 2Mi budget")
        assert pins, "not even one copy fits"
        info = group.sampler_weights_info().result(timeout=WAIT)
        assert info["bytes"] <= info["budget_bytes"] and info["loaded"] == [], info
        with tinker.ServiceClient(base_url=served["url"], api_key=served["key"]) as sc:
            tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
            with pytest.raises(Exception, match=r"samplerWeightsMemory.*kind='inflight'"):
                tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
            for name in pins:
                group.drop_sampler_weights(name).result(timeout=WAIT)
            pins.clear()
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
            out = sampler.sample(prompt, num_samples=2, sampling_params=params).result(
                timeout=WAIT
            )
            assert len(out.sequences) == 2
    finally:
        for name in pins:
            group.drop_sampler_weights(name).result(timeout=WAIT)
