"""Trainer pieces that need no process group: batches, attention, rotary, settings, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import megatron.core  # noqa: F401
import pytest
import torch

from tests.trainer.scenarios import tiny_spec
from tgruntime.trainer.batch import lm_batch, split_microbatches
from tgruntime.trainer.checkpoint import latest_checkpoint, step_dirname
from tgruntime.trainer.engine import StepResult, TrainEngine
from tgruntime.trainer.primitives import _default_micro_batch_size
from tgruntime.trainer.settings import resolve_settings

pytestmark = pytest.mark.megatron


def test_lm_batch_shifts_labels_and_masks_last_position() -> None:
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    b = lm_batch(ids, device=torch.device("cpu"), vocab_size=10)
    assert b.tokens.tolist() == ids.tolist()
    assert b.labels[:, :-1].tolist() == [[2, 3, 4], [6, 7, 8]]
    assert b.loss_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    parts = split_microbatches(b, 1)
    assert [p.tokens.tolist() for p in parts] == [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([1, 2, 3]), "must be \\[batch, seq\\]"),
        (torch.tensor([[1, 2, 30]]), "must lie in \\[0, 10\\)"),
        (torch.tensor([[1.0, 2.0]]), "must be int64"),
        (torch.tensor([[1]]), "at least 2 tokens"),
    ],
)
def test_lm_batch_rejects_bad_input(ids: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        lm_batch(ids, device=torch.device("cpu"), vocab_size=10)


def test_default_micro_batch_size() -> None:
    assert _default_micro_batch_size(16, 1) == 16
    assert _default_micro_batch_size(16, 2) == 4  # 4 micro-batches for 2 stages
    assert _default_micro_batch_size(4, 2) == 1
    assert _default_micro_batch_size(6, 4) == 1
    assert _default_micro_batch_size(3, 2) == 1


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q [s, b, np, d], k/v [s, b, ng, d] -> [s, b, np * d], in float64
    s, b, n_heads, d = q.shape
    rep = n_heads // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, n_heads * d)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_sdpa_attention_matches_reference(groups: int) -> None:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tgruntime.trainer.sdpa_attention import SDPAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=groups,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    attn = SDPAttention(config, 1, AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(6, 2, groups, 8, generator=g, dtype=torch.float64)
    v = torch.randn(6, 2, groups, 8, generator=g, dtype=torch.float64)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    assert out.shape == (6, 2, 32)
    torch.testing.assert_close(out, _reference_attention(q, k, v))


def test_device_local_rotary_stays_on_cpu() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from tgruntime.trainer.rotary import DeviceLocalRotaryEmbedding, make_rotary_cpu_safe

    holder = torch.nn.Module()
    holder.rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    make_rotary_cpu_safe(holder)
    assert isinstance(holder.rope, DeviceLocalRotaryEmbedding)
    emb = holder.rope(5)
    assert emb.device.type == "cpu" and emb.shape == (5, 1, 1, 8)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = torch.outer(torch.arange(5, dtype=torch.float32), inv)
    torch.testing.assert_close(emb[:, 0, 0], torch.cat([freqs, freqs], -1))


def test_settings_on_cpu() -> None:
    s = resolve_settings(tiny_spec(), device="cpu")
    assert (s.device, s.dtype, s.backend, s.position_embedding) == (
        "cpu",
        torch.float32,
        "gloo",
        "learned_absolute",
    )
    assert (
        resolve_settings(tiny_spec(positionEmbedding="rope"), device="cpu").position_embedding
        == "rope"
    )
    if not torch.cuda.is_available():
        gpu_spec = tiny_spec()
        assert not gpu_spec.workers.use_gpu
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_settings(gpu_spec, device="cuda")


def test_create_rejects_context_parallel() -> None:
    spec = tiny_spec(world=4)
    spec = dataclasses.replace(spec, parallelism=dataclasses.replace(spec.parallelism, context=2))
    with pytest.raises(ValueError, match="context"):
        TrainEngine.create(spec=spec)


def test_latest_checkpoint_picks_highest_complete_step(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for step, complete in [(2, True), (10, True), (11, False)]:
        d = tmp_path / step_dirname(step)
        d.mkdir()
        if complete:
            (d / "meta.json").write_text(json.dumps({"format": 1, "step": step}))
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000010"
    assert latest_checkpoint(tmp_path / "step_00000002") == tmp_path / "step_00000002"


def test_step_result_metrics_are_scalars() -> None:
    r = StepResult(
        step=1,
        per_sample_loss=(1.0, 2.0),
        loss=1.5,
        grad_norm=0.5,
        tokens=64,
        step_time_s=0.1,
        lr=1e-3,
    )
    m = r.metrics()
    assert "per_sample_loss" not in m
    assert m["loss"] == 1.5 and m["tokens"] == 64 and m["skipped"] is False
