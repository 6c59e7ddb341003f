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
