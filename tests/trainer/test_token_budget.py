"""The token budget (spec.training.microBatchTokens): a call bigger than one micro-batch may be
is split, and its losses and gradients equal the same call in one piece (and in budget-sized
calls), for every registered loss and both reductions (real megatron-core, TP=2, CPU, gloo);
plus the split itself (pure)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from tgruntime.trainer.token_budget import (
    TokenBudgetError,
    activation_bytes_per_token,
    auto_budget,
    plan_by_length,
    plan_micro_batches,
)


def _plan(rows: int, seq: int, *, pp: int = 1, mbs: int = 0, budget: int = 0) -> list[int]:
    plan = plan_micro_batches(
        rows=rows, seq_length=seq, pp=pp, micro_batch_size=mbs or rows, budget=budget, source="t"
    )
    return [b - a for a, b in plan.bounds]


def test_the_split_fits_the_budget_and_keeps_every_row() -> None:
    assert _plan(10, 100) == [10]  # no budget: as configured
    assert _plan(10, 100, budget=1000) == [10]
    assert _plan(10, 100, budget=300) == [3, 3, 3, 1]  # no pipelining: the last one shorter
    assert _plan(10, 100, pp=2, mbs=5, budget=300) == [2, 2, 2, 2, 2]  # equal sizes under PP
    assert _plan(7, 100, pp=2, mbs=7, budget=300) == [1] * 7
    assert _plan(4, 100, mbs=1, budget=10_000) == [1, 1, 1, 1]  # a smaller configured size stays
    with pytest.raises(TokenBudgetError, match=r"a row of 100 tokens .* 64 tokens \(t\)"):
        _plan(2, 100, budget=64)


def _by_length(lengths: list[int], *, seq: int = 64, mbs: int = 100, budget: int = 0) -> Any:
    plan = plan_by_length(lengths=lengths, seq_length=seq, micro_batch_size=mbs, budget=budget,
                          source="t")
    return [[plan.order[i] for i in range(a, b)] + [w] for a, b, w in plan.groups]


def test_the_split_by_length_cuts_each_micro_batch_to_its_longest_row() -> None:
    lengths = [40, 7, 64, 18, 3, 33]
    # no budget: one micro-batch, as wide as the longest row
    assert _by_length(lengths) == [[2, 0, 5, 3, 1, 4, 64]]
    # a budget of 96 tokens: longest first, widths rounded up to 16 (at most the call's 64)
    assert _by_length(lengths, budget=96) == [[2, 64], [0, 5, 48], [3, 1, 4, 32]]
    assert _by_length(lengths, budget=96, mbs=2) == [[2, 64], [0, 5, 48], [3, 1, 32], [4, 16]]
    # ties keep the request's order; a width the rounding would push over the budget stays exact
    assert _by_length([5, 9, 9, 5], budget=9) == [[1, 9], [2, 9], [0, 5], [3, 5]]
    with pytest.raises(TokenBudgetError, match=r"a row of 64 tokens .* 48 tokens \(t\)"):
        _by_length(lengths, budget=48)
    assert _by_length([]) == []


def test_the_automatic_budget_follows_free_memory_within_bounds() -> None:
    # a 1.2 B-like block in bf16: ~1.6 MiB per token; 120 GiB free -> ~30 k tokens
    per = activation_bytes_per_token(hidden=2048, layers_local=16, vocab=32000, tp=1,
                                     element_bytes=2)
    assert 1_000_000 < per < 2_000_000
    assert 20_000 < auto_budget(free_bytes=120 * 2**30, per_token=per) < 40_000
    assert auto_budget(free_bytes=0, per_token=per) == 1024
    assert auto_budget(free_bytes=2**50, per_token=1) == 1 << 20


@pytest.mark.megatron  # imports megatron-core (primitives): where that import is paid anyway
def test_the_automatic_budget_is_chosen_per_call_from_what_is_free_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The budget chosen at start counted the sampler's KV pool and weight copies, allocated
    later, as free (an H100 ran out of memory); per call it sees free + PyTorch's cached blocks
    now. A fixed spec value, or the CPU, keeps the start's figure. (The CUDA memory queries are
    stubbed: this is the decision only; the GPU run is bench/gpu/rl_memory.sh.)"""
    from types import SimpleNamespace

    from tgruntime.trainer.primitives import Primitives

    gib = 2**30
    mem = {"free": 58 * gib, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (mem["free"], 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: mem["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: mem["allocated"])
    eng = Primitives()
    eng.settings = SimpleNamespace(on_gpu=True)  # type: ignore[assignment]
    eng.device = torch.device("cpu")
    per = 2**20
    eng._per_token, eng._token_budget, eng._token_budget_source = per, 99, "at start"
    start = eng._call_budget()["budget"]
    assert start == auto_budget(free_bytes=58 * gib, per_token=per)
    mem["free"] = 30 * gib  # the sampler's pool and copies took 28 GiB since
    assert eng._call_budget()["budget"] == auto_budget(free_bytes=30 * gib, per_token=per)
    mem["reserved"], mem["allocated"] = 10 * gib, 4 * gib  # 6 GiB cached, reusable
    got = eng._call_budget()
    assert got["budget"] == auto_budget(free_bytes=36 * gib, per_token=per) < start
    assert "36.0 GiB" in got["source"] and "microBatchTokens" in got["source"]
    eng._per_token = None  # spec.training.microBatchTokens set: the start's figure stays
    assert eng._call_budget() == {"budget": 99, "source": "at start"}


@pytest.fixture(scope="module")
def suite() -> list[dict[str, Any]]:
    pytest.importorskip("megatron.core")
    from tests.trainer import budget_scenarios
    from tgruntime.trainer.launch import launch

    blobs = launch(budget_scenarios.budget_suite, world_size=2, timeout_s=600)
    return [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]


@pytest.mark.megatron
def test_a_call_over_the_budget_equals_it_in_one_piece_for_every_loss(
    suite: list[dict[str, Any]],
) -> None:
    from tests.trainer.budget_scenarios import LOSSES

    for rank in suite:
        assert rank["budget"] == 64 and "microBatchTokens 64" in rank["source"]
        # longest rows first, each micro-batch cut to its longest row: 3 micro-batches, not 5
        assert rank["micro_shapes"] == [(2, 32), (4, 16), (4, 16)]
        assert rank["log_prob_diff"] < 1e-5
        assert rank["log_prob_diff_alone"] < 1e-5
        for name in LOSSES:
            for reduction in ("sum", "mean"):
                r = rank[f"{name}/{reduction}"]
                tol = 1e-5 * max(1.0, abs(r["whole"]))
                assert abs(r["split"] - r["whole"]) < tol, (name, reduction, r)
                assert abs(r["parts"] - r["whole"]) < tol, (name, reduction, r)
                assert r["per_sample_split"] == pytest.approx(r["per_sample_whole"], abs=1e-5)
                assert r["per_sample_split"] == pytest.approx(r["per_sample_parts"], abs=1e-5)
                gtol = 1e-5 * max(1.0, r["grad_scale"])
                assert r["grad_split_vs_whole"] < gtol, (name, reduction, r)
                assert r["grad_parts_vs_whole"] < gtol, (name, reduction, r)


@pytest.mark.megatron
def test_a_row_over_the_budget_is_refused_and_the_group_stays_usable(
    suite: list[dict[str, Any]],
) -> None:
    for rank in suite:
        assert rank["refused"] is not None
        assert "a row of 32 tokens" in rank["refused"] and "16 tokens" in rank["refused"]
        assert "spec.training.microBatchTokens" in rank["refused"]
        assert rank["after_refusal"] > 0


@pytest.mark.megatron
def test_soft_targets_in_one_pass_equal_k_rows(suite: list[dict[str, Any]]) -> None:
    """``[B, S, K]`` targets and weights (Tinker's top-K distillation) in one forward pass give
    the loss, the per-sample losses, the gradient and the ``[B, S, K]`` log-probs of the same
    targets sent as K rows of ``[B, S]``, in one piece and split by the token budget; a
    policy-gradient loss refuses them."""
    from tests.trainer.scenarios import SEQ
    from tests.trainer.soft_scenarios import ROWS, K

    for rank in suite:
        soft = rank["soft"]
        if "logprob_shape" in soft:
            assert soft["logprob_shape"] == (ROWS, SEQ, K)
            assert soft["logprob_diff"] < 1e-5
        for reduction in ("sum", "mean"):
            r = soft[reduction]
            tol = 1e-5 * max(1.0, abs(r["loss_rows"]))
            assert abs(r["loss_soft"] - r["loss_rows"]) < tol, (reduction, r)
            assert abs(r["loss_split"] - r["loss_rows"]) < tol, (reduction, r)
            assert r["tokens"][0] == pytest.approx(r["tokens"][1], rel=1e-6)
            if r["per_sample_rows"] is not None:
                assert r["per_sample_soft"] == pytest.approx(
                    r["per_sample_rows"].tolist(), abs=1e-4)
            gtol = 1e-5 * max(1.0, r["grad_scale"])
            assert r["grad_soft_vs_rows"] < gtol, (reduction, r)
            assert r["grad_split_vs_rows"] < gtol, (reduction, r)
            assert r["fb_logprob_diff"] < 1e-5
        assert soft["refused"] is not None and "soft targets" in soft["refused"]
