"""The group's sampler (docs/sampling.md) on a real TP=2 MegatronTrainer group (Ray, CPU, gloo).

One module-scoped group of two workers (tiny Llama: RoPE, GQA with 2 key/value groups) for
every group assertion, plus one spawned single-rank run for the KV-cache unit check:

* sampled log-probs equal ``compute_log_prob`` on the same sequence, and transformers'
  ``LlamaForCausalLM`` log-probs on the ``export_hf`` weights (fp32, atol 1e-4);
* prompt log-probs (first None) equal the same references;
* the same seed and request give the same tokens; another seed other tokens; a prompt's
  tokens do not depend on the other prompts of the batch;
* stop sequences end a sequence ("stop"), ``max_tokens`` otherwise ("length");
* a snapshot keeps serving its weights after ``optim_step`` changes the training weights,
  in memory and from its directory;
* bad requests are refused with a clear error, and the group stays usable;
* the KV-cache decode gives the logits of a full forward (one rank, both position types).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from tests.fixtures_ray import RayCluster  # noqa: E402
from tests.trainer import sampler_scenarios  # noqa: E402
from tests.trainer.groups import trainer_group  # noqa: E402
from tests.trainer.scenarios import SEQ, VOCAB, fixed_batch, tiny_spec  # noqa: E402
from tgruntime.controller.errors import WorkerMethodError  # noqa: E402
from tgruntime.driver.trainer_client import TrainerClient  # noqa: E402
from tgruntime.trainer.launch import launch  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

ATOL = 1e-4
PROMPTS = [[3, 17, 42, 5, 9], [100, 2], [7, 7, 8, 1, 30, 31, 64, 12, 90]]


@pytest.fixture(scope="module")
def client(ray_driver: RayCluster) -> Iterator[TrainerClient]:
    spec = tiny_spec(tp=2, positionEmbedding="rope", numQueryGroups=2)
    wg = trainer_group(spec, prefix="sampler")
    try:
        wg.init_model()
        c = TrainerClient(wg)
        c.train_step({"input_ids": fixed_batch()}).result()  # weights no longer the initial ones
        yield c
    finally:
        wg.teardown()


def _group_log_probs(c: TrainerClient, seqs: list[list[int]]) -> list[list[float]]:
    """compute_log_prob per sequence (right-padded batch, cut to each length)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    out = c.compute_log_prob({"input_ids": ids, "attention_mask": mask}).result()
    assert out.batch is not None
    lp = out.batch["log_probs"]
    return [lp[i, : len(s) - 1].tolist() for i, s in enumerate(seqs)]


def _hf_log_probs(path: Path, seqs: list[list[int]]) -> list[list[float]]:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    out = []
    for s in seqs:
        ids = torch.tensor([s])
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(lp.tolist())
    return out


@pytest.fixture(scope="module")
def sampled(client: TrainerClient, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sampler")
    out: dict[str, Any] = {}
    out["a"] = client.sample(PROMPTS, max_tokens=12, seed=5, prompt_logprobs=True).result()
    out["a_again"] = client.sample(PROMPTS, max_tokens=12, seed=5, prompt_logprobs=True).result()
    out["other_seed"] = client.sample(PROMPTS, max_tokens=12, seed=6).result()
    out["alone"] = client.sample([PROMPTS[2]], max_tokens=12, seed=5).result()
    seqs = [p + r["sequences"][0]["tokens"] for p, r in zip(PROMPTS, out["a"], strict=True)]
    out["seqs"] = seqs
    out["group_lp"] = _group_log_probs(client, seqs)
    client.export_hf(str(root / "hf")).result()
    out["hf_lp"] = _hf_log_probs(root / "hf", seqs)
    return out


def test_sampled_logprobs_equal_compute_log_prob_and_transformers(sampled: dict[str, Any]) -> None:
    for prompt, res, group, hf in zip(
        PROMPTS, sampled["a"], sampled["group_lp"], sampled["hf_lp"], strict=True
    ):
        seq = res["sequences"][0]
        assert len(seq["tokens"]) == len(seq["logprobs"]) == 12
        assert seq["stop_reason"] == "length"
        gen = torch.tensor(seq["logprobs"])
        n = len(prompt)
        torch.testing.assert_close(gen, torch.tensor(group[n - 1 :]), atol=ATOL, rtol=0)
        torch.testing.assert_close(gen, torch.tensor(hf[n - 1 :]), atol=ATOL, rtol=0)
        plp = res["prompt_logprobs"]
        assert len(plp) == n and plp[0] is None
        ref = torch.tensor(hf[: n - 1])
        torch.testing.assert_close(torch.tensor(plp[1:]), ref, atol=ATOL, rtol=0)


def test_fixed_seed_gives_the_same_tokens(sampled: dict[str, Any]) -> None:
    assert sampled["a"] == sampled["a_again"]
    tokens = [r["sequences"][0]["tokens"] for r in sampled["a"]]
    assert tokens != [r["sequences"][0]["tokens"] for r in sampled["other_seed"]]
    # a prompt's tokens do not depend on the batch it came with
    assert sampled["alone"][0]["sequences"][0]["tokens"] == tokens[2]
    assert sampled["other_seed"][0]["prompt_logprobs"] is None


def test_num_samples_stop_greedy_and_filters(client: TrainerClient) -> None:
    res = client.sample([PROMPTS[0]], max_tokens=8, seed=1, num_samples=4).result()
    seqs = res[0]["sequences"]
    assert len(seqs) == 4 and len({tuple(s["tokens"]) for s in seqs}) > 1
    # stop on the sampled sequence's own third token (as a one-token stop) and on a 2-token one
    first = seqs[0]["tokens"]
    stop_tok = first[2]
    cut = first.index(stop_tok) + 1
    res = client.sample([PROMPTS[0]], max_tokens=8, seed=1, stop=[[stop_tok]]).result()
    s0 = res[0]["sequences"][0]
    assert s0["stop_reason"] == "stop" and s0["tokens"] == first[:cut]
    assert s0["logprobs"] == pytest.approx(seqs[0]["logprobs"][:cut], abs=1e-6)
    pair = first[3:5]
    res = client.sample([PROMPTS[0]], max_tokens=8, seed=1, stop=[pair, [VOCAB - 1, 0]]).result()
    end = next(i + 2 for i in range(len(first) - 1) if first[i : i + 2] == pair)
    assert res[0]["sequences"][0]["tokens"] == first[:end]
    # greedy is the argmax of the log-probs; top_k=1 is greedy too
    greedy = client.sample(PROMPTS, max_tokens=6, temperature=0.0).result()
    # the last one-shot call's split (Sampler.last): its rows and decode steps; device
    # seconds are CUDA events' (0 on the CPU)
    split = client.sampler_weights_info().result()["one_shot"]
    assert split["rows"] == len(PROMPTS) and split["steps"] == 5, split
    assert split["prefill_device_s"] == split["decode_device_s"] == 0.0, split
    top1 = client.sample(PROMPTS, max_tokens=6, top_k=1, seed=3).result()
    assert [g["sequences"] for g in greedy] == [t["sequences"] for t in top1]
    nucleus = client.sample(PROMPTS, max_tokens=6, top_p=1e-6, seed=4).result()
    assert [g["sequences"] for g in greedy] == [t["sequences"] for t in nucleus]


def test_snapshot_serves_its_weights_after_optim_step(
    client: TrainerClient, tmp_path: Path
) -> None:
    path = tmp_path / "snap"
    info = client.save_sampler_weights("before", str(path)).result()
    assert info["name"] == "before" and info["path"] == str(path) and info["bytes"] > 0
    before = client.sample(PROMPTS, max_tokens=6, seed=9).result()
    fb = client.forward_backward({"input_ids": fixed_batch(seed=3)})
    client.optim_step(lr=5e-2).result()
    fb.result()
    now = client.sample(PROMPTS, max_tokens=6, seed=9).result()
    assert now != before  # the training weights changed
    assert client.sample(PROMPTS, max_tokens=6, seed=9, weights="before").result() == before
    assert client.sample(PROMPTS, max_tokens=6, seed=9, weights=str(path)).result() == before
    assert client.sample(PROMPTS, max_tokens=6, seed=9).result() == now  # swapped back


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts": [[1, 2]], "max_tokens": SEQ}, "maxSequenceLength"),
        ({"prompts": [[VOCAB]], "max_tokens": 2}, "outside the vocabulary"),
        ({"prompts": [[]], "max_tokens": 2}, "empty"),
        ({"prompts": [[1]], "max_tokens": 0}, "max_tokens"),
        ({"prompts": [[1]], "max_tokens": 2, "top_p": 0.0}, "top_p"),
        ({"prompts": [[1]], "max_tokens": 2, "top_k": 0}, "top_k"),
        ({"prompts": [[1]], "max_tokens": 2, "weights": "nope"}, "no sampler weights"),
    ],
)
def test_bad_requests_are_refused(
    client: TrainerClient, kwargs: dict[str, Any], message: str
) -> None:
    prompts = kwargs.pop("prompts")
    with pytest.raises(WorkerMethodError, match=message):
        client.sample(prompts, **kwargs).result()
    assert len(client.sample([[1, 2]], max_tokens=2, seed=0).result()) == 1


_QWEN = {"positionEmbedding": "rope", "normalization": "RMSNorm", "activation": "swiglu"}


@pytest.mark.parametrize(
    ("positions", "extra", "env", "path"),
    [
        ("rope", {}, {}, "lean"),
        ("rope", {**_QWEN, "lora": "rows"}, {}, "lean+lora"),
        ("rope", {**_QWEN, "lora": "rows"}, {"TG_SAMPLER_COMPILE": "1"}, "compiled+lora"),
        ("rope", {**_QWEN, "lora": "uniform"}, {"TG_SAMPLER_COMPILE": "1"}, "compiled+lora"),
        ("rope", {**_QWEN, "lora": "rows"}, {"TG_SAMPLER_LEAN_LORA": "0"}, "modules+lora"),
        ("learned_absolute", {"normalization": "LayerNorm", "activation": "gelu"}, {}, "lean"),
        ("rope", {**_QWEN, "architecture": "qwen2"}, {}, "lean"),
        ("rope", {**_QWEN, "architecture": "qwen3"}, {"TG_SAMPLER_COMPILE": "1"}, "compiled"),
        ("rope", {}, {"TG_SAMPLER_LEAN": "0"}, "modules"),
        # spawn: Triton must import after TRITON_INTERPRET is set, not in the fork server
        ("rope", {}, {"TRITON_INTERPRET": "1", "TG_LAUNCH_START": "spawn"}, "lean+kernel"),
    ],
    ids=[
        "rope",
        "row-adapters",
        "row-adapters-compiled",
        "one-adapter-uniform-map-compiled",
        "row-adapters-modules",
        "learned-layernorm-gelu",
        "qwen2-bias",
        "qwen3-qknorm-compiled",
        "modules",
        "gqa-triton-kernel-interpreted",
    ],
)
def test_kv_cache_decode_equals_full_forward(
    positions: str,
    extra: dict[str, str],
    env: dict[str, str],
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill and cached decode (rows in step, and rows at different positions) give
    ``GPTModel.forward``'s logits, through the decode path named (the lean layers, eager or
    compiled with ``torch.compile`` on the CPU, with the Triton decode-attention kernel run by
    Triton's interpreter, or the model's modules)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    extra = dict(extra)
    lora = str(extra.pop("lora", ""))
    (r,) = launch(
        sampler_scenarios.kv_cache_matches_full_forward,
        world_size=1,
        kwargs={"position_embedding": positions, "extra": extra, "lora": lora},
        timeout_s=600,
    )
    ran = "compiled" if r["compiled"] else "lean" if r["lean"] else "modules"
    if r["path"] == "modules":
        ran = "modules"
    if r["kernel"]:
        ran += "+kernel"
    if lora:  # the lean layers' own per-row deltas, or the hooks through the modules
        assert r["path"] in ("lean+lora", "modules"), r
        ran += "+lora"
    assert ran == path, r
    assert r["prefill"] < 1e-5 and r["decode"] < 1e-5 and r["staggered"] < 1e-5, r


def test_each_kind_of_lean_step_compiles_its_own_few_variants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Base rows, per-row adapters and one adapter for every row, each at three batch
    sizes, compiled: each kind keeps its own compiled variants (a static and a dynamic
    batch), far from Dynamo's limit per code object, past which steps run uncompiled (one
    pair for all kinds reached it in a LoRA group's life)."""
    monkeypatch.setenv("TG_SAMPLER_COMPILE", "1")
    (r,) = launch(sampler_scenarios.compiled_variants, world_size=1, timeout_s=600)
    assert r["paths"] == ["lean+lora"] * 6 + ["lean"] * 3, r
    assert sorted(r["variants"]) == ["base", "rows", "uniform"], r
    assert all(1 <= n <= 3 for n in r["variants"].values()), r
    assert r["limit"] >= 8, r


def test_sampling_under_pipeline_parallelism(tmp_path: Path) -> None:
    """Two pipeline stages: the first embeds and runs its layers, hands the hidden states to
    the second, which computes the logits and shares them; both ranks sample the same
    tokens, whose log-probs (and the prompt's) equal ``LlamaForCausalLM``'s on the exported
    weights (1e-4, fp32), and a prompt sampled alone gets the tokens it got in the batch.
    Each prompt is prefilled once for its two samples; prefilling every row gives the same."""
    ranks = launch(
        sampler_scenarios.pipeline_sampling,
        world_size=2,
        kwargs={"root": str(tmp_path), "pipeline": 2},
        timeout_s=600,
    )
    first, last = sorted(ranks, key=lambda r: r["rank"])
    assert first["pp"] == 2 and not first["graphs"]
    assert first["results"] == last["results"]  # every stage holds the same tokens
    alone, batched = first["alone"][0]["sequences"], first["results"][1]["sequences"]
    assert [q["tokens"] for q in alone] == [q["tokens"] for q in batched]
    for a, b in zip(alone, batched, strict=True):  # other batch shapes: last-bit rounding
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]))
    # 3 prompts x 2 samples: one prompt a row, then 1 prompt alone, then every row (6)
    assert first["prefill_rows"] == [3, 1, 6]
    for shared, every in zip(first["results"], first["every_row"], strict=True):
        assert [q["tokens"] for q in shared["sequences"]] == [
            q["tokens"] for q in every["sequences"]
        ]
        for a, b in zip(shared["sequences"], every["sequences"], strict=True):
            torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]))
        torch.testing.assert_close(
            torch.tensor(shared["prompt_logprobs"][1:]), torch.tensor(every["prompt_logprobs"][1:])
        )
    reference = iter(first["reference"])
    for res in first["results"]:
        plp = res["prompt_logprobs"]
        for seq in res["sequences"]:
            want = next(reference)
            n = len(plp)
            assert len(seq["tokens"]) == 10
            torch.testing.assert_close(
                torch.tensor(seq["logprobs"]), torch.tensor(want[n - 1 :]), atol=ATOL, rtol=0
            )
            torch.testing.assert_close(
                torch.tensor(plp[1:]), torch.tensor(want[: n - 1]), atol=ATOL, rtol=0
            )
