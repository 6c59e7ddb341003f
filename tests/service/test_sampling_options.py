"""top_k, top_p and temperature through the unmodified SDK, the server and the TP=2 group.

The exact statistics are checked on the token choice alone (tests/trainer/test_sampling_select.py);
this checks that each option reaches it. The first token's full distribution is read off
the model's own log-probs, which every sampled token carries: 1,024 draws at temperature 100
(near uniform) see every token of the 128-id vocabulary. Then, one token per draw:

* top_k=3: every token is one of the 3 most likely, and more than one of them is drawn;
* top_p=0.1: every token lies in the nucleus (a sampler that ignored it draws from the
  whole vocabulary);
* a temperature of a sixth of the gap between the two best log-probs draws the argmax most
  of the time, temperature 1 rarely.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tests.service.test_sdk_flow import VOCAB, WAIT, _sc

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types
PROMPT = [2, 11, 12, 13]


def _draw(sampler: Any, seeds: range, n: int, **options: Any) -> list[tuple[int, float]]:
    """(token, model log-prob) of one-token samples, ``n`` per seed (all requests in flight)."""
    futures = [
        sampler.sample(
            T.ModelInput.from_ints(PROMPT),
            num_samples=n,
            sampling_params=T.SamplingParams(max_tokens=1, seed=seed, stop=[], **options),
        )
        for seed in seeds
    ]
    out = []
    for f in futures:
        for s in f.result(timeout=WAIT).sequences:
            assert len(s.tokens) == 1
            out.append((int(s.tokens[0]), float(s.logprobs[0])))
    return out


def test_top_k_top_p_and_temperature_reach_the_sampler(served: dict[str, Any]) -> None:
    with _sc(served) as sc:
        sampler = sc.create_sampling_client(base_model=served["base"])
        seen = dict(_draw(sampler, range(8), 128, temperature=100.0))
        assert len(seen) == VOCAB, f"{VOCAB - len(seen)} tokens never drawn at temperature 100"
        lp = np.array([seen[t] for t in range(VOCAB)])
        order = np.argsort(-lp)
        p = np.exp(lp - lp.max())
        p /= p.sum()

        top3 = set(order[:3].tolist())
        got = _draw(sampler, range(100, 104), 64, top_k=3)
        assert {t for t, _ in got} <= top3, ({t for t, _ in got} - top3, top3)
        assert len({t for t, _ in got}) > 1
        # without the filter, 256 draws at temperature 1 leave the top 3 (near uniform model)
        assert p[order[:3]].sum() < 0.5

        top_p = 0.1
        before = np.cumsum(p[order]) - p[order]
        nucleus = set(order[before < top_p + 1e-4].tolist())  # a hair wide at the border
        assert len(nucleus) < VOCAB / 2
        got = _draw(sampler, range(200, 204), 64, top_p=top_p)
        assert {t for t, _ in got} <= nucleus, ({t for t, _ in got} - nucleus, nucleus)

        best = int(order[0])
        gap = float(lp[order[0]] - lp[order[1]])
        assert gap > 0
        cold = _draw(sampler, range(300, 304), 64, temperature=gap / 6)
        warm = _draw(sampler, range(300, 304), 64, temperature=1.0)
        # at gap/6 the argmax has at least e^6 / (e^6 + 127) = 0.76 of the mass
        cold_share = sum(t == best for t, _ in cold) / len(cold)
        warm_share = sum(t == best for t, _ in warm) / len(warm)
        assert cold_share > 0.6, (cold_share, gap)
        assert warm_share < p[best] + 0.1, (warm_share, p[best])
        assert math.isfinite(gap)
