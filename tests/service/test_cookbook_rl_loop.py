"""tinker-cookbook 0.6.1's ``recipes/rl_loop.py`` with ``loss_fn="gspo"``, as SDK calls.

0.6.1 does not install here (it needs ``tml-renderers>=0.4.1``, which this index does not
serve), so this test makes the calls the recipe's ``main`` makes, in its order, read from its
source (tinker_cookbook/recipes/rl_loop.py of the 0.6.1 wheel), on the toy task of
test_sdk_flow's RL loop instead of GSM8K (after the prompt ``[BOS, d]``, a first token with an
even id scores 1, else 0; a random policy scores about 1/2):

- ``ServiceClient(user_metadata=...)``, ``create_lora_training_client(base_model, rank)``;
  ``SamplingParams(max_tokens, stop)`` and ``AdamParams(lr, beta1=0.9, beta2=0.95, eps=1e-8)``;
- each batch: ``save_weights_and_get_sampling_client(record_stability_info=False)`` (the
  recipe asks for records only for ``stable_reinforce``), every prompt's
  ``sample(prompt, num_samples=group_size)`` sent before any result is read; the group's
  advantages ``reward - mean``, a group whose advantages are all 0 skipped;
- per sequence the recipe's datum: ``prompt + sampled[:-1]`` in, ``[0] * ob_len + sampled``
  out, the sampled log-probs and the advantage padded with 0 over the prompt, and (gspo only)
  ``sequence_ratio_mask`` ``[0] * ob_len + [1] * len(sampled)``, all ``TensorData.from_torch``;
- ``forward_backward(datums, loss_fn="gspo")`` and ``optim_step`` sent together, then both
  results; at the end ``save_state("final")`` and ``save_weights_for_sampler("final")`` (its
  ``checkpoint_utils.save_checkpoint(kind="both")``).

Asserted: the reward rises (the last 4 batches' mean over the first 4's + 0.2); 16 batches of
4 prompts x 8 samples of 2 tokens, lr 1e-2: 0.53, 0.25, 0.47, 0.75 -> 0.97, 1.0, 0.94 at the end.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import WAIT

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
T = tinker.types

GROUP_SIZE, PROMPTS, MAX_TOKENS, LR, STEPS = 8, 4, 2, 1e-2, 16


def _reward(tokens: list[int]) -> float:
    return float(tokens[0] % 2 == 0)


def _gspo_datum(prompt: Any, sampled: list[int], logprobs: list[float], adv: float) -> Any:
    """rl_loop's datum for ``loss_fn="gspo"``."""
    from tinker.types.tensor_data import TensorData

    ob_len = prompt.length - 1
    model_input = prompt.append(T.EncodedTextChunk(tokens=sampled[:-1]))
    target_tokens = [0] * ob_len + sampled
    padded_logprobs = [0.0] * ob_len + logprobs
    padded_advantages = [0.0] * ob_len + [adv] * (model_input.length - ob_len)
    assert model_input.length == len(target_tokens) == len(padded_logprobs)
    inputs = {
        "target_tokens": TensorData.from_torch(torch.tensor(target_tokens)),
        "logprobs": TensorData.from_torch(torch.tensor(padded_logprobs)),
        "advantages": TensorData.from_torch(torch.tensor(padded_advantages)),
        "sequence_ratio_mask": TensorData.from_torch(
            torch.tensor([0.0] * ob_len + [1.0] * len(sampled))),
    }
    return T.Datum(model_input=model_input, loss_fn_inputs=inputs)


def test_rl_loop_gspo_reward_rises(served: dict[str, Any]) -> None:
    rng = np.random.default_rng(2)
    rewards: list[float] = []
    with tinker.ServiceClient(base_url=served["url"], api_key=served["key"],
                              user_metadata={"recipe": "recipe_rl_loop"}) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=4).result()
        params = T.SamplingParams(max_tokens=MAX_TOKENS, stop=[])
        adam = T.AdamParams(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8)
        for _ in range(STEPS):
            sampler = tc.save_weights_and_get_sampling_client(
                record_stability_info=False).result()
            prompts = [T.ModelInput.from_ints([2, int(d)])
                       for d in rng.integers(0, 10, size=PROMPTS)]
            futures: list[Future[Any]] = [
                sampler.sample(prompt=p, num_samples=GROUP_SIZE, sampling_params=params)
                for p in prompts
            ]
            datums: list[Any] = []
            rewards_p: list[float] = []
            for future, prompt in zip(futures, prompts, strict=True):
                seqs = future.result(timeout=WAIT).sequences
                rewards_g = [_reward(list(s.tokens)) for s in seqs]
                mean = sum(rewards_g) / len(rewards_g)
                rewards_p.append(mean)
                advantages = [r - mean for r in rewards_g]
                if all(a == 0.0 for a in advantages):
                    continue
                for s, adv in zip(seqs, advantages, strict=True):
                    assert s.logprobs is not None
                    datums.append(_gspo_datum(prompt, list(s.tokens), list(s.logprobs), adv))
            rewards.append(sum(rewards_p) / len(rewards_p))
            if datums:
                fb = tc.forward_backward(datums, loss_fn="gspo")
                opt = tc.optim_step(adam)
                assert np.isfinite(fb.result(timeout=WAIT).metrics["loss:sum"])
                opt.result(timeout=WAIT)
        state = tc.save_state("final").result(timeout=WAIT)
        sampler_path = tc.save_weights_for_sampler("final").result(timeout=WAIT)
        assert state.path and sampler_path.path
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    print(f"rl_loop gspo rewards {[round(x, 2) for x in rewards]}")
    assert last > first + 0.2, rewards
