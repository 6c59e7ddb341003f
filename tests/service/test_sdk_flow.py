"""The unmodified tinker SDK (0.38.0) against the server over a TP=2 group (CPU, gloo)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
WAIT = 300.0
VOCAB = 128


def _sc(served: dict[str, Any]) -> Any:
    return tinker.ServiceClient(base_url=served["url"], api_key=served["key"])


def _datum(tokens: list[int], weights: list[float] | None = None) -> Any:
    inp, tgt = tokens[:-1], tokens[1:]
    w = weights if weights is not None else [1.0] * len(tgt)
    return T.Datum(
        model_input=T.ModelInput.from_ints(inp),
        loss_fn_inputs={
            "target_tokens": np.asarray(tgt, np.int64),
            "weights": np.asarray(w, np.float32),
        },
    )


def _batch(seed: int = 0, n: int = 2, length: int = 17) -> list[Any]:
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        toks = [int(t) for t in g.integers(2, VOCAB, size=length - i * 3)]
        out.append(_datum(toks))
    return out


def _hf_loss(path: str, data: list[Any]) -> float:
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(path).double().eval()
    total = 0.0
    for d in data:
        ids = torch.tensor([d.model_input.to_ints()])
        tgt = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
        w = torch.tensor(d.loss_fn_inputs["weights"].to_numpy(), dtype=torch.float64)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0], -1)
        total += float(-(lp.gather(-1, tgt[:, None])[:, 0] * w).sum())
    return total


def test_training_flow_cross_entropy_against_float64_and_loss_falls(
    served: dict[str, Any],
) -> None:
    data = _batch(0)
    with _sc(served) as sc:
        caps = sc.get_server_capabilities()
        assert caps.supported_models[0].model_name == served["base"]
        tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
        # The reference: the same weights exported to Hugging Face format (float64 in HF).
        hf = served["root"] / "hf0"
        served["client"].export_hf(str(hf)).result(timeout=WAIT)
        want = _hf_loss(str(hf), data)
        fwd = tc.forward(data, "cross_entropy").result(timeout=WAIT)
        fb = tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        assert abs(fwd.metrics["loss:sum"] - want) < 1e-3 * max(1.0, abs(want))
        assert abs(fb.metrics["loss:sum"] - want) < 1e-3 * max(1.0, abs(want))
        lp = [o["logprobs"].to_numpy() for o in fb.loss_fn_outputs]
        assert [len(x) for x in lp] == [len(d.model_input.to_ints()) for d in data]
        np.testing.assert_allclose(
            np.concatenate(lp),
            np.concatenate([o["logprobs"].to_numpy() for o in fwd.loss_fn_outputs]),
            atol=1e-5,
        )
        losses = [fb.metrics["loss:sum"]]
        adam = T.AdamParams(learning_rate=1e-2)
        tc.optim_step(adam).result(timeout=WAIT)
        for _ in range(4):
            fb = tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
            tc.optim_step(adam).result(timeout=WAIT)
            losses.append(fb.metrics["loss:sum"])
        assert losses[-1] < losses[0] * 0.9, losses


def _rl_datum(prompt: list[int], ans: list[int], old: list[float], adv: float) -> Any:
    toks = prompt + ans
    n = len(toks) - 1
    k = len(prompt) - 1  # positions before the answer carry no loss
    zeros = [0.0] * k
    return T.Datum(
        model_input=T.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(toks[1:], np.int64),
            "logprobs": np.asarray(zeros + list(old), np.float32),
            "advantages": np.asarray(zeros + [adv] * len(ans), np.float32),
            "weights": np.asarray(zeros + [1.0] * len(ans), np.float32),
        }
        if n
        else {},
    )


def test_each_loss_matches_its_definition_on_policy(served: dict[str, Any]) -> None:
    """On-policy (old logprobs = the model's): ratio 1, so each loss has a closed form."""
    prompt, ans = [3, 9, 4], [17, 22, 5]
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        base = tc.forward([_datum(prompt + ans)], "cross_entropy").result(timeout=WAIT)
        lp = base.loss_fn_outputs[0]["logprobs"].to_numpy()
        old = [float(x) for x in lp[len(prompt) - 1 :]]
        a = 0.5
        d = _rl_datum(prompt, ans, old, a)
        # gspo's sequence ratio over the answer's tokens (the prompt's logprobs are not the
        # sampler's): on-policy it is 1, as each token's ratio
        inputs = dict(d.loss_fn_inputs)
        inputs["sequence_ratio_mask"] = inputs["weights"]
        d_gspo = T.Datum(model_input=d.model_input, loss_fn_inputs=inputs)
        expect = {
            "importance_sampling": -a * len(ans),
            "ppo": -a * len(ans),
            "cispo": -a * sum(old),
            "dro": -a * sum(old),
            "gspo": -a * len(ans),
        }
        config: dict[str, dict[str, float]] = {"dro": {"beta": 0.1}}
        for loss, want in expect.items():
            datum = d_gspo if loss == "gspo" else d
            cfg = config.get(loss)
            # forward runs no loss on the group: the server reports the same loss:sum
            fwd = tc.forward([datum], loss, loss_fn_config=cfg).result(timeout=WAIT)
            assert abs(fwd.metrics["loss:sum"] - want) < 1e-4, (loss, fwd.metrics, want)
            out = tc.forward_backward([datum], loss, loss_fn_config=cfg).result(timeout=WAIT)
            assert abs(out.metrics["loss:sum"] - want) < 1e-4, (loss, out.metrics, want)
            got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
            np.testing.assert_allclose(got, lp, atol=1e-5)
        with pytest.raises(Exception, match="record_stability_info"):  # no provenance
            tc.forward_backward([d], "stable_reinforce").result(timeout=WAIT)
        tc.optim_step(T.AdamParams(learning_rate=1e-3)).result(timeout=WAIT)


def test_sampling_compute_logprobs_and_seeds(served: dict[str, Any]) -> None:
    prompt = T.ModelInput.from_ints([5, 6, 7, 8])
    params = T.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        path = tc.save_weights_for_sampler("s0").result(timeout=WAIT).path
        assert path.endswith("/sampler_weights/s0")
        sampler = sc.create_sampling_client(model_path=path)
        r1 = sampler.sample(prompt, num_samples=3, sampling_params=params).result(timeout=WAIT)
        r2 = sampler.sample(prompt, num_samples=3, sampling_params=params).result(timeout=WAIT)
        assert len(r1.sequences) == 3
        assert [s.tokens for s in r1.sequences] == [s.tokens for s in r2.sequences]
        for seq in r1.sequences:
            assert len(seq.tokens) == 6 and seq.stop_reason == "length"
            full = T.ModelInput.from_ints([5, 6, 7, 8, *seq.tokens])
            plp = sampler.compute_logprobs(full).result(timeout=WAIT)
            assert plp[0] is None
            np.testing.assert_allclose(plp[4:], seq.logprobs, atol=1e-4)
        # save_weights_and_get_sampling_client: in-memory weights, same distribution
        sc2 = tc.save_weights_and_get_sampling_client()
        r3 = sc2.sample(prompt, num_samples=3, sampling_params=params).result(timeout=WAIT)
        assert [s.tokens for s in r3.sequences] == [s.tokens for s in r1.sequences]
        # the checkpoints listing sees the sampler weights
        rest = sc.create_rest_client()
        cps = rest.list_checkpoints(tc.model_id).result(timeout=WAIT)
        assert any(c.tinker_path == path for c in cps.checkpoints)


def test_save_state_then_from_state_with_optimizer_gives_the_same_next_loss(
    served: dict[str, Any],
) -> None:
    data = _batch(3)
    other = _batch(4)  # the step after the save: unlike the optimizer's moments so far
    adam = T.AdamParams(learning_rate=5e-3)
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        fresh = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        for _ in range(2):
            tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
            tc.optim_step(adam).result(timeout=WAIT)
        path = tc.save_state("mid").result(timeout=WAIT).path
        at_save = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        tc.forward_backward(other, "cross_entropy").result(timeout=WAIT)
        tc.optim_step(adam).result(timeout=WAIT)
        want = tc.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        tc2 = sc.create_training_client_from_state_with_optimizer(path)
        tc2.forward_backward(other, "cross_entropy").result(timeout=WAIT)
        tc2.optim_step(adam).result(timeout=WAIT)
        got = tc2.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        assert abs(got - want) < 1e-4 * max(1.0, abs(want)), (got, want)
        # weights only (fresh optimizer): the saved weights, then a step without the moments.
        # A load that did nothing would start at the fresh run's loss; one that also restored
        # the optimizer would step to ``got``. The saved run is 2 steps away from both.
        assert abs(at_save - fresh) > 1e-2 * max(1.0, abs(fresh)), (at_save, fresh)
        tc3 = sc.create_training_client_from_state(path)
        start = tc3.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        assert abs(start - at_save) < 1e-4 * max(1.0, abs(at_save)), (start, at_save, fresh)
        tc3.forward_backward(other, "cross_entropy").result(timeout=WAIT)
        tc3.optim_step(adam).result(timeout=WAIT)
        step = tc3.forward(data, "cross_entropy").result(timeout=WAIT).metrics["loss:sum"]
        assert abs(step - got) > 1e-3 * max(1.0, abs(got)), (step, got, start)


def test_rl_loop_reward_rises(served: dict[str, Any]) -> None:
    """Toy task: after the prompt [BOS, d], answer an even token id (reward 1, else 0).

    A random policy scores about 1/2; the verifier is the parity check."""
    rng = np.random.default_rng(0)
    rewards: list[float] = []
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        for it in range(16):
            sampler = tc.save_weights_and_get_sampling_client().result()
            data, rs = [], []
            for d in rng.integers(0, 10, size=4):
                prompt = [2, int(d)]
                res = sampler.sample(
                    T.ModelInput.from_ints(prompt), num_samples=8,
                    sampling_params=T.SamplingParams(max_tokens=1, seed=it * 100 + int(d),
                                                     stop=[]),
                ).result(timeout=WAIT)
                r = [float(s.tokens[0] % 2 == 0) for s in res.sequences]
                mean = sum(r) / len(r)
                rs += r
                for s, ri in zip(res.sequences, r, strict=True):
                    data.append(_rl_datum(prompt, list(s.tokens), list(s.logprobs), ri - mean))
            rewards.append(sum(rs) / len(rs))
            loss = "importance_sampling" if it % 2 == 0 else "ppo"
            tc.forward_backward(data, loss).result(timeout=WAIT)
            tc.optim_step(T.AdamParams(learning_rate=1e-2)).result(timeout=WAIT)
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert last > first + 0.2, rewards
