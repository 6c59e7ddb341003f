"""The sampler's token choice (``tgruntime.trainer.sampling.select``) under top-k, top-p and
temperature: pure torch on CPU, no Ray, no model.

Each check draws thousands of tokens from fixed logits, one row per seed (the row keys the
sampler derives from a request's seed), and compares them with a float64 reference built
here from the definitions, not from the code under test:

* every token lies in the top-k set / the top-p nucleus (of ``logits / temperature``), and
  the filter is not a collapse to greedy (several tokens of the set are drawn);
* the empirical frequencies match the renormalised reference distribution, for temperatures
  0.25 .. 4 and for top-k and top-p combined with a temperature;
* a lower temperature draws the argmax token more often and gives a lower entropy;
* the reported log-prob is the model's own (temperature 1, no filter), whatever the options.

A sampler that ignored ``top_k``, ``top_p`` or ``temperature`` fails each of them: the logits
are flat enough that the tokens outside the sets hold most of the mass.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tgruntime.trainer.sampling.params import SamplingParams, row_keys
from tgruntime.trainer.sampling.select import next_token

VOCAB = 40
DRAWS = 20_000
PROMPT = [2, 7, 9]


def _logits(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """One row of fp32 logits, distinct values (no ties at a set's border)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * scale


def _keys(n: int, first_seed: int = 0) -> torch.Tensor:
    """One noise key per draw: request seeds ``first_seed .. first_seed + n - 1``."""
    keys = [row_keys([PROMPT], seed=s, num_samples=1)[0] for s in range(first_seed, first_seed + n)]
    return torch.tensor(keys, dtype=torch.int64)


def _draw(
    logits: torch.Tensor, n: int = DRAWS, step: int = 0, **options: float
) -> tuple[np.ndarray, np.ndarray]:
    params = SamplingParams.build(max_tokens=1, vocab_size=VOCAB, **options)  # type: ignore[arg-type]
    rows = logits.unsqueeze(0).expand(n, VOCAB).contiguous()
    token, logprob = next_token(rows, _keys(n), step, params)
    return token.numpy(), logprob.numpy()


def _reference(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0
) -> np.ndarray:
    """The distribution to sample from, float64: softmax of logits / temperature, restricted
    to the top-k tokens, then to the nucleus (the best tokens until their mass reaches top_p,
    the one that crosses it included), renormalised."""
    z = logits.double().numpy() / temperature
    order = np.argsort(-z)
    keep = np.zeros(VOCAB, bool)
    keep[order[: top_k if top_k > 0 else VOCAB]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        mass = 0.0
        nucleus = np.zeros(VOCAB, bool)
        for t in order:
            if not keep[t] or mass >= top_p:
                break
            nucleus[t] = True
            mass += p[t]
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def _frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=VOCAB) / len(tokens)


def _assert_matches(tokens: np.ndarray, want: np.ndarray) -> None:
    got = _frequencies(tokens)
    outside = got[want == 0].sum()
    assert outside == 0, f"{outside:.1%} of the draws fell outside the allowed set"
    # DRAWS = 20,000: a frequency's standard deviation is at most 0.0035; 0.02 is > 5 sigma
    worst = np.abs(got - want).max()
    assert worst < 0.02, (worst, got.round(3), want.round(3))


@pytest.mark.parametrize("top_k", [2, 5, 12])
def test_top_k_draws_only_the_k_best_tokens(top_k: int) -> None:
    logits = _logits(1)
    want = _reference(logits, top_k=top_k)
    assert want[want == 0].size == VOCAB - top_k
    # without the filter most draws would fall outside the set
    assert _reference(logits)[want == 0].sum() > 0.2
    tokens, _ = _draw(logits, top_k=top_k)
    assert set(tokens.tolist()) == set(np.flatnonzero(want).tolist())  # all k, no other
    _assert_matches(tokens, want)


@pytest.mark.parametrize("top_p", [0.2, 0.5, 0.9])
def test_top_p_draws_only_the_nucleus(top_p: float) -> None:
    logits = _logits(2)
    want = _reference(logits, top_p=top_p)
    nucleus = np.flatnonzero(want)
    assert 1 < nucleus.size < VOCAB
    assert _reference(logits)[want == 0].sum() > 0.05
    tokens, _ = _draw(logits, top_p=top_p)
    assert set(tokens.tolist()) == set(nucleus.tolist())
    _assert_matches(tokens, want)


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_temperature_sets_the_distribution(temperature: float) -> None:
    logits = _logits(3)
    tokens, _ = _draw(logits, temperature=temperature)
    _assert_matches(tokens, _reference(logits, temperature=temperature))


def test_a_lower_temperature_draws_the_argmax_more_often_and_with_less_entropy() -> None:
    logits = _logits(4)
    best = int(logits.argmax())
    share, entropy = [], []
    for temperature in (4.0, 2.0, 1.0, 0.5, 0.25, 0.1):
        tokens, _ = _draw(logits, temperature=temperature)
        f = _frequencies(tokens)
        share.append(f[best])
        entropy.append(float(-(f[f > 0] * np.log(f[f > 0])).sum()))
    assert all(a < b for a, b in itertools.pairwise(share)), share
    assert all(a > b for a, b in itertools.pairwise(entropy)), entropy
    assert share[-1] > 0.5 > share[0] * 5, share
    greedy, _ = _draw(logits, n=100, temperature=0.0)
    assert (greedy == best).all()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.5, 10, 0.8), (2.0, 6, 0.7), (1.5, -1, 0.6)]
)
def test_top_k_top_p_and_temperature_together(temperature: float, top_k: int, top_p: float) -> None:
    logits = _logits(5)
    want = _reference(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, _ = _draw(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    _assert_matches(tokens, want)


def test_every_row_keeps_its_own_set_in_a_mixed_batch() -> None:
    """Rows with different logits in one call: each token is in its own row's top-k."""
    g = torch.Generator().manual_seed(6)
    rows = torch.randn(4_000, VOCAB, generator=g)
    params = SamplingParams.build(max_tokens=1, top_k=3, top_p=0.9, vocab_size=VOCAB)
    for step in (0, 1, 7):
        token, _ = next_token(rows, _keys(len(rows), first_seed=step * 10_000), step, params)
        top3 = torch.topk(rows, 3, dim=-1).indices
        assert (top3 == token.unsqueeze(-1)).any(-1).all()
        assert len(set(token.tolist())) > 3  # the rows' sets differ


def test_the_reported_logprob_is_the_models_own() -> None:
    logits = _logits(7)
    own = torch.log_softmax(logits.double(), -1).numpy()
    for options in ({}, {"temperature": 0.3, "top_k": 4}, {"temperature": 3.0, "top_p": 0.5}):
        tokens, logprobs = _draw(logits, n=500, **options)  # type: ignore[arg-type]
        np.testing.assert_allclose(logprobs, own[tokens], atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
@pytest.mark.parametrize("vocab", [32_000, 128_256])
def test_the_compiled_draw_chooses_what_the_eager_one_does_on_a_gpu(vocab: int) -> None:
    """``draw.draw`` (compiled on CUDA) against its eager body: the same tokens, bit for bit
    (the noise hash is integer arithmetic), the same log-probs to fp32 rounding; rows at
    temperature 0 (greedy), filtered and unfiltered logits, batches of 1, 7 and 64."""
    from tgruntime.trainer.sampling.draw import _draw as eager
    from tgruntime.trainer.sampling.draw import draw
    from tgruntime.trainer.sampling.noise import token_salts

    g = torch.Generator(device="cuda").manual_seed(3)
    for rows, step in ((1, 0), (7, 5), (64, 200)):
        logits = torch.randn(rows, vocab, device="cuda", generator=g) * 4
        temperature = torch.rand(rows, device="cuda", generator=g) + 0.25
        temperature[0] = 0.0
        keys = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
        steps = torch.full((rows,), step, dtype=torch.int64, device="cuda")
        for z in (None, logits / 0.7):
            want = eager(logits, z, temperature, keys, steps, token_salts(vocab, logits.device))
            got = draw(logits, z, temperature, keys, steps)
            assert torch.equal(got[0], want[0]), (rows, vocab, z is None)
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_a_draw_that_fails_to_compile_falls_back_to_the_eager_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compile error (as Inductor's int32 refusal was, torch 2.9) must not fail sampling:
    the draw warns once and draws eagerly from then on, with the same tokens."""
    from tgruntime.trainer.sampling import draw as module

    calls: list[int] = []

    class Failed(torch._dynamo.exc.BackendCompilerFailed):
        def __init__(self, message: str) -> None:  # the real one's arguments vary by version
            Exception.__init__(self, message)

    def broken(*args: object) -> None:
        calls.append(1)
        raise Failed("CompilationError: Scalar out of range for type int32")

    monkeypatch.setattr(module, "_COMPILED", [broken])
    monkeypatch.setattr(module, "_BROKEN", [])
    logits = torch.stack([_logits(seed) for seed in range(4)])
    keys = _keys(len(logits))
    temperature = torch.ones(len(logits))
    step = torch.zeros(1, dtype=torch.int64)
    salts = module._salts(logits.shape[-1], logits.device)
    want = module._draw(logits, None, temperature, keys, step, salts)
    # the compiled path is CUDA's: take it here on the CPU, as _use_compiled would there
    monkeypatch.setattr(module, "_use_compiled", lambda device: not module._BROKEN)
    with caplog.at_level("WARNING", logger="tgruntime.trainer.sampling.draw"):
        for _ in range(3):
            got = module.draw(logits, None, temperature, keys, step)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert calls == [1]  # tried once, then given up for the process
    assert "drawing eagerly from now on" in caplog.text and "int32" in caplog.text


def test_every_caller_of_the_compiled_draw_shares_its_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real Dynamo (a counting backend, on the CPU): the forms the warm-up meets (one-shot
    sampling's ``[1]`` temperature with logits that view the decoder's ``[1, R, V]`` output;
    the engine's per-row settings at its batch buckets) leave nothing to compile for an RL
    call's forms (a prompt's samples made by ``repeat_interleave``, an int step, a bucket
    not met). Without ``_one_signature`` that call compiled a new graph (an H100's first
    client call took 2.3 s against 0.5 s; TORCH_LOGS=recompiles named the draw). Each draw
    also equals the eager one."""
    from torch._dynamo.testing import CompileCounter

    from tgruntime.trainer.sampling import draw as module

    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(module._draw, backend=counter, fullgraph=True, dynamic=True)
    monkeypatch.setattr(module, "_COMPILED", [compiled])
    monkeypatch.setattr(module, "_BROKEN", [])
    monkeypatch.setattr(module, "_use_compiled", lambda device: True)
    salts = module._salts(VOCAB, torch.device("cpu"))

    def check(logits: torch.Tensor, temperature: torch.Tensor, step: torch.Tensor | int) -> None:
        keys = _keys(logits.shape[0])
        got = module.draw(logits, None, temperature, keys, step)
        want = module._draw(logits, None, temperature, keys, step, salts)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def one_shot(rows: int, *, samples: int = 1, step: torch.Tensor | int = 0) -> None:
        out = torch.stack([_logits(r) for r in range(rows)]).unsqueeze(0)  # [1, R, V]
        logits = out[0] if samples == 1 else out[0].repeat_interleave(samples, dim=0)
        check(logits, torch.ones(1), torch.zeros(1, dtype=torch.int64) if step == 0 else step)

    def engine(rows: int) -> None:
        logits = torch.stack([_logits(r) for r in range(rows)])
        check(logits, torch.rand(rows) + 0.5, torch.arange(rows))

    for rows in (2, 3):  # the warm-up's two generations
        one_shot(rows)
    for bucket in (1, 2, 4, 8, 16):  # the engine's graphs
        engine(bucket)
    warm = counter.frame_count
    assert warm <= 2  # one graph for a single row, one for every batch of two or more
    one_shot(8, samples=8)
    one_shot(5, samples=2, step=7)
    engine(48)
    one_shot(1)
    assert counter.frame_count == warm
