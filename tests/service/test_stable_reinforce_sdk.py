"""``stable_reinforce`` through the unmodified SDK (0.38), the server and the TP=2 group.

Sampling clients made with ``record_stability_info=True``; datums annotated with
``Datum.with_provenance`` as the cookbook's ``rl_loop`` does (prompt runs, then the sampled
run). The toy task of test_sdk_flow's RL loop (after [BOS, d], answer an even token id):
the reward rises with stable_reinforce alone; on the first batch ``forward`` reports the
on-policy loss ``-sum(A * logp)`` of the recorded log-probs. The refusals: a recorded sample
at another temperature, a sequence sampled without recording, a datum whose targets are not
the tokens its provenance names.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import WAIT, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types


def _datum(prompt: list[int], seq: Any, adv: float) -> Any:
    """rl_loop's datum: prompt + sampled[:-1] in; placeholders on the prompt, then the sampled
    tokens out; the advantage on the sampled tokens; provenance on both fields."""
    toks, sid = list(seq.tokens), seq.sequence_id
    k = len(prompt) - 1
    datum = T.Datum(
        model_input=T.ModelInput.from_ints(prompt + toks[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray([0] * k + toks, np.int64),
            "advantages": np.asarray([0.0] * k + [adv] * len(toks), np.float32),
        },
    )
    inputs = [T.PromptProvenanceSpan(sequence_id=sid, length=len(prompt))]
    if len(toks) > 1:
        inputs.append(T.SampledProvenanceSpan(sequence_id=sid, length=len(toks) - 1))
    return datum.with_provenance(
        model_input=inputs,
        loss_fn_inputs=[
            T.PromptProvenanceSpan(sequence_id=sid, offset=1, length=k),
            T.SampledProvenanceSpan(sequence_id=sid, length=len(toks)),
        ],
    )


def test_stable_reinforce_reward_rises(served: dict[str, Any]) -> None:
    rng = np.random.default_rng(1)
    rewards: list[float] = []
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        for it in range(16):
            sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
            data, rs, on_policy, scale = [], [], 0.0, 0.0
            for d in rng.integers(0, 10, size=4):
                prompt = [2, int(d)]
                res = sampler.sample(
                    T.ModelInput.from_ints(prompt), num_samples=8,
                    sampling_params=T.SamplingParams(max_tokens=2, seed=it * 100 + int(d),
                                                     stop=[]),
                ).result(timeout=WAIT)
                ids = [s.sequence_id for s in res.sequences]
                assert all(ids) and len(set(ids)) == len(ids), ids
                r = [float(s.tokens[0] % 2 == 0) for s in res.sequences]
                mean = sum(r) / len(r)
                rs += r
                for s, ri in zip(res.sequences, r, strict=True):
                    data.append(_datum(prompt, s, ri - mean))
                    on_policy -= (ri - mean) * float(np.sum(s.logprobs))
                    scale += abs(ri - mean) * float(np.sum(1.0 + np.abs(s.logprobs)))
            if it == 0:  # the recorded log-probs are the learner's (to ~1e-4): r = 1, so the
                # loss is -sum(A logp); the bound allows 2e-4 per token on logp and on r
                fwd = tc.forward(data, "stable_reinforce").result(timeout=WAIT)
                assert abs(fwd.metrics["loss:sum"] - on_policy) < 2e-4 * scale + 1e-6, (
                    fwd.metrics, on_policy, scale)
            rewards.append(sum(rs) / len(rs))
            tc.forward_backward(data, "stable_reinforce").result(timeout=WAIT)
            tc.optim_step(T.AdamParams(learning_rate=1e-2)).result(timeout=WAIT)
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    print(f"stable_reinforce rewards {[round(x, 2) for x in rewards]}")
    assert last > first + 0.2, rewards


def test_stable_reinforce_refusals(served: dict[str, Any]) -> None:
    prompt = T.ModelInput.from_ints([2, 3])
    params = T.SamplingParams(max_tokens=2, seed=5, stop=[])
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        # a sampling client's in-memory weights last until the next one is saved: unrecorded
        # first, then recorded
        plain = tc.save_weights_and_get_sampling_client().result()
        unrecorded = plain.sample(prompt, num_samples=1, sampling_params=params).result(
            timeout=WAIT).sequences[0]
        recorded = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        hot = T.SamplingParams(max_tokens=2, seed=5, stop=[], temperature=0.5)
        with pytest.raises(Exception, match=r"temperature 1\.0, top_k -1 and top_p 1\.0"):
            recorded.sample(prompt, num_samples=1, sampling_params=hot).result(timeout=WAIT)
        with pytest.raises(Exception, match="has no stability record"):
            tc.forward_backward([_datum([2, 3], unrecorded, 1.0)], "stable_reinforce").result(
                timeout=WAIT)
        seq = recorded.sample(prompt, num_samples=1, sampling_params=params).result(
            timeout=WAIT).sequences[0]
        good = _datum([2, 3], seq, 1.0)
        inputs = dict(good.loss_fn_inputs)
        target = inputs["target_tokens"].to_numpy().copy()
        target[-1] = (target[-1] + 1) % 128
        inputs["target_tokens"] = target
        bad = T.Datum(model_input=good.model_input, loss_fn_inputs=inputs).with_provenance(
            model_input=good.model_input_spans, loss_fn_inputs=good.loss_fn_input_spans)
        with pytest.raises(Exception, match="provenance does not match"):
            tc.forward_backward([bad], "stable_reinforce").result(timeout=WAIT)
        out = tc.forward_backward([good], "stable_reinforce").result(timeout=WAIT)
        assert np.isfinite(out.metrics["loss:sum"])
