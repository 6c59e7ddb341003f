"""Qwen2 and Qwen3 beside Llama (docs/models.md): conversion, megatron model, sampler.

Pure checks (no torch.distributed): the Hugging Face names and shapes are transformers' own,
HF -> megatron -> tensor-parallel shards -> HF is bit-identical (the fused QKV bias included),
config.json round-trips, and what the trainer cannot build is refused naming the key.

One launch of two processes (CPU, gloo; ``tgruntime.trainer.launch``) for every layout of
both architectures, each built from ``spec.model.pretrained`` of a tiny checkpoint that
transformers created here (Qwen2 with tied embeddings; Qwen3 untied with ``head_dim`` 32, not
hidden/heads = 16; random biases and q/k norms, so a misplaced row shows): TP=1 (two data
replicas), TP=2 and PP=2 each ``import_hf`` it, compute log-probs, ``export_hf`` it again,
sample greedily (not PP: the sampler needs every layer on a rank), take one training step and
export again. Log-probs and sampled log-probs must equal transformers' within float32
rounding (atol 2e-5 / 1e-4), exports bit-identical to the checkpoint; after the step the tied
copies on the two pipeline stages agree and all layouts hold nearly the same weights.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tgapi
from tests.trainer.scenarios import (
    FFN,
    HEADS,
    HIDDEN,
    LAYERS,
    SEQ,
    VOCAB,
    _quiet,
    fixed_batch,
    tiny_spec,
    write_tokenizer,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("megatron.core")

from tgruntime.trainer.hf_weights import (  # noqa: E402
    LlamaShape,
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    tp_merge,
    tp_split,
)

pytestmark = pytest.mark.megatron

ATOL = 2e-5  # log-probs against transformers (fp32 on CPU; test_hf_group.py's figure)
SAMPLE_ATOL = 1e-4  # sampled log-probs (test_sampler.py's figure)
GROUPS = 2
ARCHS: dict[str, dict[str, Any]] = {
    # Qwen2: QKV bias, tied embeddings (as Qwen2-0.5B)
    "qwen2": {"tie_word_embeddings": True, "rope_theta": 1_000_000.0},
    # Qwen3: q/k norms, an explicit head_dim unlike hidden/heads
    "qwen3": {"tie_word_embeddings": False, "rope_theta": 500_000.0, "head_dim": 32},
}
LAYOUTS: dict[str, dict[str, int]] = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}
PROMPT = [3, 17, 42, 5, 9]
NEW_TOKENS = 6


def _hf_class(arch: str) -> Any:
    return {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[arch]


def _config(arch: str, **change: Any) -> Any:
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": GROUPS,
        "max_position_embeddings": SEQ,
        "rms_norm_eps": 1e-6,
    }
    return cls(**{**fields, **ARCHS[arch], **change})


def _shape(arch: str, **change: Any) -> LlamaShape:
    return LlamaShape.from_hf_config(_config(arch, **change).to_dict())


def _random_hf(shape: LlamaShape, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shape.hf_shapes().items()}


def _save_checkpoint(arch: str, path: Path) -> None:
    """A tiny model initialised by transformers (nothing downloaded), its biases and q/k norms
    randomised, saved with a tokenizer (as spec.model.pretrained requires)."""
    torch.manual_seed(11)
    model = _hf_class(arch)(_config(arch))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "_norm" in name or name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path)
    write_tokenizer(path, VOCAB)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(file))
    return out


def _hf_log_probs(arch: str, path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = _hf_class(arch).from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def _spec(arch_dir: Path, layout: str) -> tgapi.TrainerGroupSpec:
    parallel = LAYOUTS[layout]
    return tiny_spec(
        tp=parallel.get("tp", 1),
        pp=parallel.get("pp", 1),
        pretrained=str(arch_dir / "hf"),
        positionEmbedding="rope",
        numQueryGroups=GROUPS,
    )


# -- pure conversion checks -------------------------------------------------------------
@pytest.mark.parametrize(
    ("arch", "tied"), [("qwen2", True), ("qwen2", False), ("qwen3", False), ("qwen3", True)]
)
def test_names_and_shapes_are_transformers_own(arch: str, tied: bool) -> None:
    shape = _shape(arch, tie_word_embeddings=tied)
    config = _hf_class(arch).config_class.from_dict(shape.hf_config(dtype=torch.float32))
    model = _hf_class(arch)(config)
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if tied:  # the state dict shows the tied lm_head; save_pretrained does not write it
        assert theirs.pop("lm_head.weight") == theirs["model.embed_tokens.weight"]
    assert theirs == shape.hf_shapes()
    assert list(shape.hf_shapes()) == hf_names(
        layers=range(shape.num_layers), first_stage=True, last_stage=True, shape=shape
    )
    assert LlamaShape.from_hf_config(config.to_dict()) == shape


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(
    ("heads", "tp"), [(4, 1), (4, 2), (8, 4)], ids=["tp1", "tp2", "fewer-groups-than-ranks-tp4"]
)
def test_round_trip_through_tensor_parallel_shards_is_bit_identical(
    arch: str, heads: int, tp: int
) -> None:
    shape = _shape(arch, num_attention_heads=heads, hidden_size=16 * heads)
    hf = _random_hf(shape)
    full = hf_to_megatron(hf, shape)
    names = megatron_names(layers=range(LAYERS), first_stage=True, last_stage=True, shape=shape)
    assert set(full) - {"output_layer.weight"} == set(names) - {"output_layer.weight"}
    shards = [
        {n: tp_split(n, full[n], tp_size=tp, tp_rank=r) for n in names} for r in range(tp)
    ]
    merged = {n: tp_merge(n, [s[n] for s in shards]) for n in names}
    back = megatron_to_hf(merged, shape)
    assert list(back) == list(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_fused_qkv_bias_follows_the_weight_layout() -> None:
    shape = _shape("qwen2")
    d = shape.head_dim
    hf = _random_hf(shape)
    bias = hf_to_megatron(hf, shape)["decoder.layers.1.self_attention.linear_qkv.bias"]
    q, k, v = (hf[f"model.layers.1.self_attn.{x}_proj.bias"] for x in "qkv")
    group1 = bias[4 * d : 8 * d]  # group 1: query heads 2 and 3, key head 1, value head 1
    assert torch.equal(group1, torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]))
    rank1 = tp_split("decoder.layers.1.self_attention.linear_qkv.bias", bias, tp_size=2, tp_rank=1)
    assert torch.equal(rank1, group1)


def test_tied_stages_read_the_embedding_for_the_last_stage() -> None:
    shape = _shape("qwen2")
    assert shape.tie_embeddings and "lm_head.weight" not in shape.hf_shapes()
    last = hf_names(layers=range(1, 2), first_stage=False, last_stage=True, shape=shape)
    assert last[-1] == "model.embed_tokens.weight"
    hf = _random_hf(shape)
    part = hf_to_megatron({n: hf[n] for n in last}, shape)
    assert torch.equal(part["output_layer.weight"], hf["model.embed_tokens.weight"])
    stage = megatron_names(layers=range(1, 2), first_stage=False, last_stage=True, shape=shape)
    assert "output_layer.weight" in stage  # the last of several stages holds a copy...
    assert "lm_head.weight" not in megatron_to_hf({n: part[n] for n in stage}, shape)  # ...unsaved
    one = megatron_names(layers=range(2), first_stage=True, last_stage=True, shape=shape)
    assert "output_layer.weight" not in one  # one stage reads the embedding's weight


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, r"model_type is 'mistral'.*supported: llama .*qwen3"),
        ({"model_type": "gemma2"}, r"model_type is 'gemma2'.*qwen2 \(Qwen2ForCausalLM\)"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ],
)
def test_config_refuses_what_the_trainer_cannot_build(
    change: dict[str, Any], message: str
) -> None:
    config = {**_shape("qwen3").hf_config(dtype=torch.float32), **change}
    with pytest.raises(ValueError, match=message):
        LlamaShape.from_hf_config(config)


def test_a_group_of_another_architecture_is_named() -> None:
    qwen3 = _shape("qwen3")
    with pytest.raises(ValueError, match=r"architecture: model 'qwen2', cfg 'qwen3'.*head_dim"):
        dataclasses.replace(_shape("qwen2"), tie_embeddings=False).check_compatible(
            qwen3, source="cfg"
        )


def test_lora_on_qwen_is_refused_at_create() -> None:
    """LoRA's adapters follow Llama's layout: a Qwen model (or tied embeddings) is refused
    before anything is built."""
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.lora import LoraSettings

    base: dict[str, Any] = {"positionEmbedding": "rope", "numQueryGroups": GROUPS}
    model: dict[str, Any]
    for model, field in (
        ({"architecture": "qwen2"}, "model.architecture is qwen2"),
        ({"architecture": "qwen3", "headDim": 32}, "model.architecture is qwen3"),
        ({"tieEmbeddings": True}, "model.tieEmbeddings is true"),
    ):
        spec = tiny_spec(world=1, **base, **model)
        with pytest.raises(ValueError, match=f"^lora: .*{field}"):
            TrainEngine.create(spec=spec, lora=LoraSettings(rank=4))


# -- megatron groups (one launch) ---------------------------------------------------------
def _gather_tied_copies(engine: Any) -> float:
    """Max |first stage's embedding - last stage's output copy| (PP=2 ranks, tied)."""
    module = engine.state.module
    mine = module.shared_embedding_or_output_weight().detach()
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine.contiguous())
    return float((theirs[0] - theirs[1]).abs().max())


def run_layouts(root: str) -> bytes:
    """Per-rank body: every architecture x layout (see the module doc). The result travels as
    bytes: tensors sent through the queue as shared memory need the sending process alive
    until they are read (a FileNotFoundError otherwise, as in the CI run of 2026-12-03)."""
    _quiet()
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    # one default group for every engine (as lora_scenarios.py): no re-rendezvous between them
    init_process_group(resolve_settings(tiny_spec()))
    try:
        buffer = io.BytesIO()
        torch.save(_layouts(root), buffer)
        return buffer.getvalue()
    finally:
        dist.destroy_process_group()


def _layouts(root: str) -> dict[str, Any]:
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.hf_worker import export_hf_checkpoint, import_hf_checkpoint
    from tgruntime.trainer.sampling.generate import Sampler
    from tgruntime.trainer.sampling.params import SamplingParams
    from tgruntime.trainer.token_batch import token_batch

    out: dict[str, Any] = {}
    for arch in ARCHS:
        arch_dir = Path(root) / arch
        for layout in LAYOUTS:
            start = time.perf_counter()
            key = f"{arch}-{layout}"
            spec = _spec(arch_dir, layout)
            engine = TrainEngine.create(spec=spec)
            try:
                res: dict[str, Any] = {"model": dataclasses.asdict(spec.model)}
                res["parameters"] = sorted(n for n, _ in engine.state.module.named_parameters())
                import_hf_checkpoint(engine, path=str(arch_dir / "hf"))
                batch = token_batch(
                    {"input_ids": fixed_batch(seed=7)}, device=engine.device, vocab_size=VOCAB
                )
                res["log_probs"] = engine.compute_log_prob(batch).log_probs
                export_hf_checkpoint(engine, path=str(arch_dir / layout / "export"))
                if engine.mesh_info.pp_size == 1:
                    params = SamplingParams.build(
                        max_tokens=NEW_TOKENS, temperature=0.0, vocab_size=VOCAB
                    )
                    res["sample"] = Sampler(engine.state.module).generate([PROMPT], params)[0]
                data = fixed_batch(seed=0)
                if engine.mesh_info.dp_size > 1:  # each replica its half of the batch
                    half = data.shape[0] // engine.mesh_info.dp_size
                    data = data[engine.mesh_info.dp_rank * half :][:half]
                engine.train_step(data)
                if engine.mesh_info.pp_size > 1 and spec.model.tie_embeddings:
                    res["tied_gap"] = _gather_tied_copies(engine)
                export_hf_checkpoint(engine, path=str(arch_dir / layout / "stepped"))
                res["seconds"] = time.perf_counter() - start
                out[key] = res
            finally:
                engine.shutdown()
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tgruntime.trainer.launch import launch

    root = tmp_path_factory.mktemp("hf-qwen")
    for arch in ARCHS:
        _save_checkpoint(arch, root / arch / "hf")
    start = time.perf_counter()
    blobs = launch(run_layouts, world_size=2, kwargs={"root": str(root)}, timeout_s=900)
    ranks = [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]
    return {"root": root, "ranks": ranks, "seconds": time.perf_counter() - start}


def _last_rank_result(runs: dict[str, Any], arch: str, layout: str) -> dict[str, Any]:
    # log-probs come from the last pipeline stage (rank 1 under PP=2; any rank otherwise)
    result: dict[str, Any] = runs["ranks"][1][f"{arch}-{layout}"]
    return result


@pytest.mark.parametrize("arch", list(ARCHS))
def test_spec_model_pretrained_sets_the_architecture(runs: dict[str, Any], arch: str) -> None:
    model = _last_rank_result(runs, arch, "tp1")["model"]
    want = ARCHS[arch]
    assert model["architecture"] == arch
    assert model["tie_embeddings"] is want["tie_word_embeddings"]
    assert model["rope_theta"] == want["rope_theta"] and model["norm_epsilon"] == 1e-6
    assert model["head_dim"] == want.get("head_dim", 0)
    params = _last_rank_result(runs, arch, "tp1")["parameters"]
    assert any(n.endswith("linear_qkv.bias") for n in params) is (arch == "qwen2")
    assert any(n.endswith("q_layernorm.weight") for n in params) is (arch == "qwen3")
    assert ("output_layer.weight" in params) is (not want["tie_word_embeddings"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_log_probs_equal_transformers(runs: dict[str, Any], arch: str, layout: str) -> None:
    ours = _last_rank_result(runs, arch, layout)["log_probs"]
    ref = _hf_log_probs(arch, runs["root"] / arch / "hf", fixed_batch(seed=7))
    assert ours.shape == ref.shape == (4, SEQ - 1)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_import_then_export_is_bit_identical(runs: dict[str, Any], arch: str, layout: str) -> None:
    root = runs["root"] / arch
    original, exported = _tensors(root / "hf"), _tensors(root / layout / "export")
    assert set(exported) == set(original)
    if ARCHS[arch]["tie_word_embeddings"]:
        assert "lm_head.weight" not in exported
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads((root / layout / "export" / "config.json").read_text())
    assert config["model_type"] == arch and config["architectures"] == [
        _hf_class(arch).__name__
    ]
    model = _hf_class(arch).from_pretrained(root / layout / "export")
    assert all(torch.equal(t, original[n]) for n, t in model.state_dict().items() if n in original)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_sample_equals_transformers(runs: dict[str, Any], arch: str, layout: str) -> None:
    (seq,) = _last_rank_result(runs, arch, layout)["sample"]["sequences"]
    model = _hf_class(arch).from_pretrained(runs["root"] / arch / "hf").eval()
    with torch.no_grad():
        ids = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, top_k=None,
            top_p=None, temperature=None, pad_token_id=0,
        )[0, len(PROMPT) :]
        logits = model(input_ids=torch.tensor([PROMPT + ids.tolist()])).logits[0].float()
    assert seq["tokens"] == ids.tolist()
    lp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(seq["logprobs"]), lp, atol=SAMPLE_ATOL, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_one_step_agrees_across_layouts(runs: dict[str, Any], arch: str) -> None:
    """The same step from the same weights in every layout (tied embeddings under PP=2: the
    embedding's gradient summed with its copy's, the copies equal afterwards).

    Adam's first step moves each weight by about lr (3e-3) times the sign of its gradient, so
    a gradient summed in another order moves a weight whose gradient is near 0 a little
    differently (measured: at most 4.7e-5, one weight in 4096); a missing or doubled term
    would move many weights by up to 2 lr. Tolerance: 1e-4."""
    root = runs["root"] / arch
    if ARCHS[arch]["tie_word_embeddings"]:
        assert _last_rank_result(runs, arch, "pp2")["tied_gap"] == 0.0
    reference = _tensors(root / "tp1" / "stepped")
    before = _tensors(root / "hf")
    assert any(not torch.equal(reference[n], before[n]) for n in before)
    for layout in ("tp2", "pp2"):
        other = _tensors(root / layout / "stepped")
        for name, tensor in reference.items():
            torch.testing.assert_close(other[name], tensor, atol=1e-4, rtol=0, msg=name)


def test_one_launch_for_every_layout(runs: dict[str, Any]) -> None:
    assert [r["rank"] for r in runs["ranks"]] == [0, 1]
    print(f"\nqwen layouts: one launch, {runs['seconds']:.1f} s")
