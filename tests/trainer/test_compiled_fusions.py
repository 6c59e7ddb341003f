"""The torch.compile'd SwiGLU and RoPE of ``tgruntime.trainer.model``: on a GPU only (a CPU
run keeps megatron's eager code, no compiler needed), ``TG_TORCH_COMPILE=0`` turns them off,
and ``compile_rope`` swaps megatron's function once (nothing is compiled or run here)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from tests.trainer.scenarios import tiny_spec
from tgruntime.trainer import model as model_mod
from tgruntime.trainer.settings import RuntimeSettings


def _settings(on_gpu: bool) -> RuntimeSettings:
    return RuntimeSettings(
        device="cuda" if on_gpu else "cpu",
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        backend="nccl" if on_gpu else "gloo",
        position_embedding="rope",
    )


def test_only_on_a_gpu_and_not_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TG_TORCH_COMPILE", raising=False)
    monkeypatch.setenv("CC", "/usr/bin/cc")
    assert model_mod.compiled_fusions(_settings(on_gpu=True))
    assert not model_mod.compiled_fusions(_settings(on_gpu=False))
    monkeypatch.setenv("TG_TORCH_COMPILE", "0")
    assert not model_mod.compiled_fusions(_settings(on_gpu=True))


def test_no_c_compiler_keeps_the_eager_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton builds a launcher with a C compiler: without one, compiling would fail the first
    step, so the eager code is kept."""
    monkeypatch.delenv("TG_TORCH_COMPILE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert model_mod.c_compiler() is None
    assert not model_mod.compiled_fusions(_settings(on_gpu=True))


def test_swiglu_fusion_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tiny_spec()  # the shared tiny shape (SwiGLU, RoPE)
    monkeypatch.setattr(model_mod, "compiled_fusions", lambda settings: settings.on_gpu)
    cpu = model_mod.transformer_config(spec.model, spec.parallelism, _settings(on_gpu=False))
    assert cpu.bias_activation_fusion is False
    monkeypatch.setattr(model_mod, "compiled_fusions", lambda settings: True)
    fused = model_mod.transformer_config(spec.model, spec.parallelism, _settings(on_gpu=False))
    assert fused.bias_activation_fusion is True


def test_compile_rope_swaps_megatrons_function_once(monkeypatch: pytest.MonkeyPatch) -> None:
    eager = rope_utils._apply_rotary_pos_emb_bshd
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", eager)  # restored afterwards
    assert model_mod.compile_rope()
    compiled = rope_utils._apply_rotary_pos_emb_bshd
    assert compiled is not eager and getattr(compiled, "__wrapped__", None) is eager
    assert model_mod.compile_rope() and rope_utils._apply_rotary_pos_emb_bshd is compiled
    monkeypatch.delattr(rope_utils, "_apply_rotary_pos_emb_bshd")
    assert not model_mod.compile_rope()
