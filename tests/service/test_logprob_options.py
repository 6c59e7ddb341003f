"""The logprob options of tinker SDK 0.38 (issue 38): the option checks, the wire shapes read
back by the SDK's own decoder, and the options end to end against ``transformers``.

Pure tests (no group): ``LogprobOptions``' refusals and the positions it scores; the
``SampleResponse`` fields the server encodes, read back by the SDK's
``deserialize_sample_response`` (top-k rows with ``None`` where not scored, a CSR target kept
sparse, alternative draws); sparse CSR loss inputs as the SDK encodes them; ``[N, K]`` soft
targets split into K rows and folded back.

End to end (the package's TP=2 group and server, the unmodified SDK): the base weights are
exported to Hugging Face format and every option is checked against ``transformers``'s
log-softmax on them: ``include_prompt_logprobs`` with ``topk_prompt_logprobs``,
``topk_sample_logprobs``, ``target_prompt_logprobs`` (dense and CSR), ``prompt_alt_tokens_k``
(draws at temperature 1, argmax at 0), ``prompt_logprobs_last_n``; the same request as a
direct one-shot ``TrainerClient.sample`` call gives the continuous engine's tokens and values;
and ``cross_entropy`` with ``[N, K]`` targets and weights (``forward`` and
``forward_backward``) gives ``-sum w * logp`` and ``[N, K]`` logprobs.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
T = tinker.types
WAIT = 300.0
VOCAB = 128
TOL = 1e-3  # the group's fp32 TP=2 log-probs against transformers' float64


# -- pure --------------------------------------------------------------------------------
def test_options_refused_with_the_field_and_scored_positions() -> None:
    from tgruntime.trainer.logprob_options import MAX_WIDTH, LogprobOptions

    def refused(raw: dict[str, Any], words: str, *, plp: bool = True) -> None:
        with pytest.raises(ValueError, match=words):
            LogprobOptions.build(raw, vocab_size=VOCAB, prompt_logprobs=plp)

    refused({"topk_prompt_logprobs": -1}, "topk_prompt_logprobs must be an integer >= 0")
    refused({"topk_sample_logprobs": MAX_WIDTH + 1}, f"over this server's limit of {MAX_WIDTH}")
    refused({"prompt_alt_tokens_k": 2.5}, "prompt_alt_tokens_k must be an integer")
    refused({"prompt_logprobs_last_n": 2}, "set prompt_logprobs", plp=False)
    refused({"prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n must be an integer >= 1")
    refused({"target_prompt_logprobs": [[-1], [-1]]}, "names no token id")
    refused({"target_prompt_logprobs": [[1, 2], [3]]}, "row 1 has 1 ids, row 0 has 2")
    refused({"target_prompt_logprobs": [[VOCAB]]}, f"id {VOCAB} .row 0. is outside")
    refused({"bogus": 1}, "unknown fields")
    opts = LogprobOptions.build(
        {"prompt_logprobs_last_n": 3, "target_prompt_logprobs": [[-1]] * 4 + [[5]] * 5},
        vocab_size=VOCAB,
        prompt_logprobs=True,
    )
    with pytest.raises(ValueError, match=re.escape("needs len(prompt) - 1 = 7")):
        opts.check_prompt(8)
    last_n_over = re.escape("prompt_logprobs_last_n 3 is over len(prompt) - 1 = 2")
    with pytest.raises(ValueError, match=last_n_over):
        LogprobOptions(last_n=3).check_prompt(3)
    opts.check_prompt(10)
    # position t predicts token t + 1: last_n 3 of 10 tokens needs t >= 6, the target t >= 4
    assert opts.first_row(10, prompt_logprobs=True) == 4
    assert LogprobOptions(last_n=3).first_row(10, prompt_logprobs=True) == 6
    assert LogprobOptions(alt_k=2, last_n=3).first_row(10, prompt_logprobs=True) == 0
    assert LogprobOptions().first_row(10, prompt_logprobs=False) is None
    assert LogprobOptions(topk_sample=3).first_row(10, prompt_logprobs=False) is None
    assert LogprobOptions.build(
        opts.as_request(), vocab_size=VOCAB, prompt_logprobs=True
    ) == opts


def test_response_fields_read_back_by_the_sdk() -> None:
    import torch
    from tinker.proto.response_conv import deserialize_sample_response

    from tgruntime.service.logprob_codec import encode_sample_with_options, parse_logprob_request
    from tgruntime.service.sessions import ServiceError

    m = 9
    ids = torch.full((m - 1, 2), -1, dtype=torch.int64)
    ids[2, 0], ids[7, 1] = 7, 9
    target = T.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert target.sparse_crow_indices is not None  # the SDK chose CSR
    body = {
        "prompt_logprobs": True,
        "prompt_logprobs_last_n": 2,
        "topk_prompt_logprobs": 2,
        "topk_sample_logprobs": 2,
        "prompt_alt_tokens_k": 3,
        "target_prompt_logprobs": {  # as the SDK's JSON carries a TensorData
            "data": target.data,
            "dtype": target.dtype,
            "shape": target.shape,
            "sparse_crow_indices": target.sparse_crow_indices,
            "sparse_col_indices": target.sparse_col_indices,
        },
    }
    req = parse_logprob_request(body, prompt_len=m, vocab_size=VOCAB)
    assert req.options.target == ((-1, -1),) * 2 + ((7, -1),) + ((-1, -1),) * 4 + ((-1, 9),)
    seqs = [
        {
            "tokens": [3, 4],
            "logprobs": [-1.0, -2.0],
            "stop_reason": "length",
            "topk_logprobs": [[[3, -1.0], [8, -1.5]], [[4, -2.0], [5, -2.5]]],
        }
    ]
    result = {
        "prompt_logprobs": [None] * 7 + [-0.5, -0.25],
        "topk_prompt_logprobs": [None] * 7 + [[[1, -0.1], [2, -0.2]], [[3, -0.3], [4, -0.4]]],
        "target_prompt_logprobs": [[0.0, 0.0]] * 2
        + [[-3.0, 0.0]]
        + [[0.0, 0.0]] * 4
        + [[0.0, -4.0]],
        "prompt_alt_tokens": {
            "tokens": [[1, 2, 3]] * (m - 1),
            "logprobs": [[-1.0, -2.0, -3.0]] * (m - 1),
        },
    }
    resp = deserialize_sample_response(encode_sample_with_options(seqs, result, req))
    assert resp.prompt_logprobs == [None] * 7 + [-0.5, -0.25]
    rows = resp.topk_prompt_logprobs
    assert rows is not None and rows[:7] == [None] * 7
    scored = [row for row in rows[7:] if row is not None]
    assert [[i for i, _ in row] for row in scored] == [[1, 2], [3, 4]]
    lps = np.array([lp for row in scored for _, lp in row])
    np.testing.assert_allclose(lps, np.array([-0.1, -0.2, -0.3, -0.4]), rtol=1e-6)
    sampled = resp.sequences[0].topk_logprobs
    assert sampled is not None
    assert [[i for i, _ in row or []] for row in sampled] == [[3, 8], [4, 5]]
    tpl = resp.target_prompt_logprobs
    assert tpl is not None
    assert tpl.sparse_crow_indices == target.sparse_crow_indices  # the request's layout
    assert tpl.sparse_col_indices == target.sparse_col_indices
    dense = tpl.to_numpy()
    assert dense.shape == (m - 1, 2) and dense[2, 0] == -3.0 and dense[7, 1] == -4.0
    assert (dense[:2] == 0).all() and (dense[3:7] == 0).all()
    alt = resp.prompt_alt_tokens
    assert alt is not None and alt.tokens.to_numpy().shape == (m - 1, 3)
    assert alt.tokens.to_numpy().tolist()[0] == [1, 2, 3]
    for bad, words in (
        ({"target_prompt_logprobs": {"data": [1], "dtype": "float32", "shape": [4, 1]}}, "int64"),
        ({"target_prompt_logprobs": {"data": [1] * 3, "dtype": "int64", "shape": [3, 1]}}, "= 8"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 9}, r"over len\(prompt\) - 1 = 8"),
        ({"topk_prompt_logprobs": 999}, "topk_prompt_logprobs 999 is over"),
    ):
        with pytest.raises(ServiceError, match=words):
            parse_logprob_request(bad, prompt_len=m, vocab_size=VOCAB)


def test_soft_targets_one_k_wide_batch_and_sparse_inputs() -> None:
    import torch
    from tinker.proto.request_conv import _tensor_data_to_proto

    from tgruntime.service.codec import DatumIn, _tensor
    from tgruntime.service.datum import forward_loss, outputs, to_tensors
    from tgruntime.service.sessions import ServiceError
    from tgruntime.service.soft_targets import fold, soft_widths

    targets = torch.zeros(6, 3, dtype=torch.int64)
    targets[1, 2], targets[4, 0] = 17, 5
    proto = _tensor_data_to_proto(T.TensorData.from_torch_sparse(targets))
    assert proto.HasField("sparse_csr")  # the SDK sends a mostly-zero 2-D input as CSR
    np.testing.assert_array_equal(_tensor("target_tokens", proto), targets.numpy())

    tokens = np.arange(4, dtype=np.int64)
    tgt = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], np.int64)
    w = np.array([[0.5, 0.5], [1, 0], [0.25, 0.75], [0, 0]], np.float32)
    plain = DatumIn(tokens[:3], {"target_tokens": tgt[:3, 0].copy()})
    soft = DatumIn(tokens, {"target_tokens": tgt, "weights": w})
    data = [plain, soft]
    widths = soft_widths(data, loss="cross_entropy")
    assert widths == [0, 2]
    batch, lengths = to_tensors(
        data, loss="cross_entropy", vocab_size=VOCAB, max_len=64, dp=1, widths=widths
    )
    assert lengths == [3, 4] and "loss_mask" not in batch
    assert tuple(batch["target_ids"].shape) == (2, 4, 2)  # K = the call's widest
    np.testing.assert_array_equal(batch["target_ids"][1].numpy(), tgt)
    np.testing.assert_array_equal(batch["target_weights"][1].numpy(), w)
    # the [N] datum: its targets in column 0 at weight 1, the other column weighs nothing
    np.testing.assert_array_equal(batch["target_ids"][0, :3, 0].numpy(), tgt[:3, 0])
    assert batch["target_weights"][0].tolist() == [[1, 0], [1, 0], [1, 0], [0, 0]]
    lp = -torch.arange(16, dtype=torch.float32).reshape(2, 4, 2)
    folded = fold(outputs(lp, lengths), widths)
    assert folded[0]["logprobs"].tolist() == [0.0, -2.0, -4.0]
    assert folded[1]["logprobs"].shape == (4, 2) and folded[1]["logprobs"][:, 1].tolist() == [
        -9.0, -11.0, -13.0, -15.0]
    want = 0.0 + 2.0 + 4.0 + (8 * 0.5 + 9 * 0.5 + 10 + 12 * 0.25 + 13 * 0.75)
    assert forward_loss("tinker_cross_entropy", lp, batch, {}) == pytest.approx(want)
    # a call with no soft datum is as before
    flat, _ = to_tensors([plain], loss="cross_entropy", vocab_size=VOCAB, max_len=64, dp=1)
    assert tuple(flat["target_ids"].shape) == (1, 3) and "loss_mask" in flat
    with pytest.raises(ServiceError, match="cross_entropy's, not 'ppo'"):
        soft_widths([soft], loss="ppo")
    with pytest.raises(ServiceError, match=re.escape("must be [4, 2] too")):
        soft_widths(
            [DatumIn(tokens, {"target_tokens": tgt, "weights": w[:, 0]})], loss="cross_entropy"
        )
    with pytest.raises(ServiceError, match="take only weights beside them"):
        soft_widths([DatumIn(tokens, {"target_tokens": tgt, "advantages": w[:, 0]})],
                    loss="cross_entropy")


# -- end to end --------------------------------------------------------------------------
def _sc(served: dict[str, Any]) -> Any:
    return tinker.ServiceClient(base_url=served["url"], api_key=served["key"])


def _reference(path: str) -> Any:
    """log-softmax rows of ``transformers``'s model on the exported weights, in float64."""
    import torch

    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(path).double().eval()

    def lsm(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens])).logits[0]
        out: np.ndarray = torch.log_softmax(logits, -1).numpy()
        return out

    return lsm


def _check_topk(pairs: list[tuple[int, float]] | None, ref: np.ndarray, k: int) -> None:
    """``pairs`` are ``ref``'s top k (ties within TOL may swap ids)."""
    assert pairs is not None and len(pairs) == k
    kth = np.sort(ref)[-k]
    lps = [lp for _, lp in pairs]
    assert lps == sorted(lps, reverse=True)
    for tid, lp in pairs:
        assert abs(ref[tid] - lp) < TOL, (tid, lp, ref[tid])
        assert ref[tid] >= kth - TOL


@pytest.mark.ray
@pytest.mark.megatron
def test_every_option_against_transformers(served: dict[str, Any]) -> None:
    import torch

    g = np.random.default_rng(38)
    prompt = [int(t) for t in g.integers(4, VOCAB, size=12)]
    m = len(prompt)
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
        hf = served["root"] / "hf_logprobs"
        served["client"].export_hf(str(hf)).result(timeout=WAIT)
        lsm = _reference(str(hf))
        sampler = tc.save_weights_and_get_sampling_client().result()

        ids = torch.from_numpy(g.integers(0, VOCAB, size=(m - 1, 3)))
        ids[0, :] = -1
        ids[5, 1] = -1
        params = T.SamplingParams(max_tokens=5, seed=7, stop=[], temperature=1.0)
        res = sampler.sample(
            T.ModelInput.from_ints(prompt),
            num_samples=2,
            sampling_params=params,
            include_prompt_logprobs=True,
            topk_prompt_logprobs=4,
            topk_sample_logprobs=3,
            target_prompt_logprobs=T.TensorData.from_torch(ids),
            prompt_alt_tokens_k=3,
        ).result(timeout=WAIT)
        ref = lsm(prompt)  # ref[t]: the distribution of token t + 1
        assert res.prompt_logprobs[0] is None
        want = [ref[t - 1, prompt[t]] for t in range(1, m)]
        np.testing.assert_allclose(res.prompt_logprobs[1:], want, atol=TOL)
        assert res.topk_prompt_logprobs[0] is None
        for t in range(1, m):
            _check_topk(res.topk_prompt_logprobs[t], ref[t - 1], 4)
        got = res.target_prompt_logprobs.to_numpy()
        assert got.shape == (m - 1, 3)
        for i in range(m - 1):
            for j in range(3):
                cell = int(ids[i, j])
                expect = 0.0 if cell < 0 else ref[i, cell]
                assert abs(got[i, j] - expect) < TOL, (i, j, got[i, j], expect)
        alt_t = res.prompt_alt_tokens.tokens.to_numpy()
        alt_lp = res.prompt_alt_tokens.logprobs.to_numpy()
        assert alt_t.shape == alt_lp.shape == (m - 1, 3)
        alt_ref = np.take_along_axis(ref[: m - 1], alt_t, axis=1)
        np.testing.assert_allclose(alt_lp, alt_ref, atol=TOL)
        assert len({tuple(r) for r in alt_t.tolist()}) > 1  # draws, not one token repeated
        for seq in res.sequences:
            full = lsm(prompt + list(seq.tokens))
            assert len(seq.topk_logprobs) == len(seq.tokens) == 5
            for j, (tok, lp) in enumerate(zip(seq.tokens, seq.logprobs, strict=True)):
                row = full[m - 1 + j]
                assert abs(row[tok] - lp) < TOL
                _check_topk(seq.topk_logprobs[j], row, 3)

        # the one-shot path (a direct group call on the same weights): the same answer
        [direct] = served["client"].sample(
            [prompt],
            max_tokens=5,
            seed=7,
            stop=[],
            num_samples=2,
            prompt_logprobs=True,
            logprob_options={
                "topk_prompt_logprobs": 4,
                "topk_sample_logprobs": 3,
                "target_prompt_logprobs": ids.tolist(),
                "prompt_alt_tokens_k": 3,
            },
        ).result(timeout=WAIT)
        assert [s["tokens"] for s in direct["sequences"]] == [s.tokens for s in res.sequences]
        assert direct["prompt_alt_tokens"]["tokens"] == alt_t.tolist()
        np.testing.assert_allclose(direct["target_prompt_logprobs"], got, atol=1e-5)
        for d_seq, s in zip(direct["sequences"], res.sequences, strict=True):
            assert [[i for i, _ in row] for row in d_seq["topk_logprobs"]] == [
                [i for i, _ in row] for row in s.topk_logprobs
            ]

        # CSR target, last_n, greedy alternative draws
        sparse = torch.full((m - 1, 2), -1, dtype=torch.int64)
        sparse[m - 2, 0], sparse[4, 1] = 3, 9
        last_n = 4
        res = sampler.sample(
            T.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=T.SamplingParams(max_tokens=1, seed=1, stop=[], temperature=0.0),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=2,
            prompt_logprobs_last_n=last_n,
            target_prompt_logprobs=T.TensorData.from_torch_sparse(sparse, pad_value=-1),
            prompt_alt_tokens_k=2,
        ).result(timeout=WAIT)
        assert res.prompt_logprobs[: m - last_n] == [None] * (m - last_n)
        assert res.topk_prompt_logprobs[: m - last_n] == [None] * (m - last_n)
        np.testing.assert_allclose(res.prompt_logprobs[m - last_n :], want[-last_n:], atol=TOL)
        for t in range(m - last_n, m):
            _check_topk(res.topk_prompt_logprobs[t], ref[t - 1], 2)
        tpl = res.target_prompt_logprobs
        assert tpl.sparse_crow_indices is not None  # answered in the request's layout
        dense = tpl.to_numpy()
        assert abs(dense[m - 2, 0] - ref[m - 2, 3]) < TOL and abs(dense[4, 1] - ref[4, 9]) < TOL
        greedy = res.prompt_alt_tokens.tokens.to_numpy()
        assert (greedy == ref[: m - 1].argmax(-1)[:, None]).all()


@pytest.mark.ray
@pytest.mark.megatron
def test_cross_entropy_with_soft_targets_against_transformers(served: dict[str, Any]) -> None:
    import torch

    g = np.random.default_rng(5)
    with _sc(served) as sc:
        tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
        hf = served["root"] / "hf_soft"
        served["client"].export_hf(str(hf)).result(timeout=WAIT)
        lsm = _reference(str(hf))
        n, k = 9, 4
        tokens = [int(t) for t in g.integers(4, VOCAB, size=n)]
        plain_tokens = [int(t) for t in g.integers(4, VOCAB, size=n + 1)]
        soft_t = g.integers(0, VOCAB, size=(n, k))
        soft_w = g.random((n, k)).astype(np.float32)
        soft_w[0] = 0.0
        sparse_t = torch.zeros(n, k, dtype=torch.int64)
        sparse_t[:, 0] = torch.from_numpy(soft_t[:, 0])  # mostly zero: the SDK sends CSR
        sparse_w = torch.zeros(n, k)
        sparse_w[:, 0] = 1.0
        data = [
            T.Datum(  # numpy [N, K]: dense on the wire
                model_input=T.ModelInput.from_ints(tokens),
                loss_fn_inputs={"target_tokens": soft_t.astype(np.int64), "weights": soft_w},
            ),
            T.Datum(  # an ordinary [N] datum in the same call
                model_input=T.ModelInput.from_ints(plain_tokens[:-1]),
                loss_fn_inputs={"target_tokens": np.asarray(plain_tokens[1:], np.int64)},
            ),
            T.Datum(  # torch [N, K]: sparse CSR on the wire
                model_input=T.ModelInput.from_ints(tokens),
                loss_fn_inputs={"target_tokens": sparse_t, "weights": sparse_w},
            ),
        ]
        ref = lsm(tokens)
        ref_plain = lsm(plain_tokens[:-1])
        lp_soft = np.take_along_axis(ref, soft_t, axis=1)
        lp_plain = ref_plain[np.arange(n), plain_tokens[1:]]
        lp_sparse = np.take_along_axis(ref, sparse_t.numpy(), axis=1)
        want = -(
            (lp_soft * soft_w).sum() + lp_plain.sum() + (lp_sparse * sparse_w.numpy()).sum()
        )
        fwd = tc.forward(data, "cross_entropy").result(timeout=WAIT)
        fb = tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
        for out in (fwd, fb):
            assert abs(out.metrics["loss:sum"] - want) < 1e-3 * max(1.0, abs(want))
            shapes = [o["logprobs"].shape for o in out.loss_fn_outputs]
            assert shapes == [[n, k], [n], [n, k]]
            for o, lp in zip(out.loss_fn_outputs, (lp_soft, lp_plain, lp_sparse), strict=True):
                np.testing.assert_allclose(o["logprobs"].to_numpy(), lp, atol=TOL)


@pytest.mark.megatron  # prompt_scores lives in the sampler's package, which imports megatron
def test_scores_compute_only_the_positions_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prompt_logprobs_last_n`` skips the prefix's output layer (the calls cover the last N
    positions only, in chunks); a target starts at its first named row; values and seeded
    alternative draws are read off the same logits."""
    import torch

    from tgruntime.trainer.sampling import prompt_scores
    from tgruntime.trainer.sampling.params import SamplingParams

    monkeypatch.setattr(prompt_scores, "CHUNK", 8)
    g = torch.Generator().manual_seed(0)
    m = 40
    logits = torch.randn(m, VOCAB, generator=g)
    prompt = torch.randint(0, VOCAB, (m,), generator=g).tolist()
    calls: list[tuple[int, int]] = []

    def logits_of(a: int, b: int) -> torch.Tensor:
        calls.append((a, b))
        return logits[a:b]

    def score(*, plp: bool = True, temperature: float = 1.0, **kw: Any) -> dict[str, Any]:
        calls.clear()
        params = SamplingParams.build(
            max_tokens=1,
            temperature=temperature,
            prompt_logprobs=plp,
            vocab_size=VOCAB,
            logprob_options=kw,
        )
        return prompt_scores.score_prompt(logits_of, prompt, params, seed=3)

    lsm = torch.log_softmax(logits, -1)
    out = score(prompt_logprobs_last_n=3, topk_prompt_logprobs=2)
    assert calls == [(36, 39)]  # positions 36..38 predict the last 3 tokens
    assert out["prompt_logprobs"][:37] == [None] * 37
    want = [float(lsm[t - 1, prompt[t]]) for t in range(37, m)]
    np.testing.assert_allclose(out["prompt_logprobs"][37:], want, rtol=1e-6)
    assert out["topk_prompt_logprobs"][36] is None
    assert [i for i, _ in out["topk_prompt_logprobs"][39]] == lsm[38].topk(2).indices.tolist()

    target = [[-1]] * 10 + [[5]] * (m - 11)
    out = score(plp=False, target_prompt_logprobs=target)
    assert calls == [(10, 18), (18, 26), (26, 34), (34, 39)]
    assert out["target_prompt_logprobs"][9] == [0.0]
    assert abs(out["target_prompt_logprobs"][20][0] - float(lsm[20, 5])) < 1e-6

    a = score(plp=False, prompt_alt_tokens_k=4)["prompt_alt_tokens"]
    assert calls[0] == (0, 8) and a == score(plp=False, prompt_alt_tokens_k=4)["prompt_alt_tokens"]
    tokens = torch.tensor(a["tokens"])
    assert tokens.shape == (m - 1, 4) and len(set(tokens.flatten().tolist())) > 20
    lp = torch.tensor(a["logprobs"], dtype=torch.float32)
    torch.testing.assert_close(lp, lsm[: m - 1].gather(-1, tokens))
    greedy = score(plp=False, temperature=0.0, prompt_alt_tokens_k=2)["prompt_alt_tokens"]
    assert greedy["tokens"] == [[int(i)] * 2 for i in logits[: m - 1].argmax(-1)]
