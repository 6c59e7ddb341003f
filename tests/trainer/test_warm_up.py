"""The compile warm-up of ``init_model`` (``tgruntime.trainer.warm_up``): run here on the CPU
(TP=2, gloo) where the policy would skip it, to show it changes nothing a user can see; on a
GPU it runs in every group start (tests/trainer/test_trainer_gpu.py reports its seconds)."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch


def test_the_policy_is_on_only_with_the_compiled_fusions(monkeypatch: pytest.MonkeyPatch) -> None:
    from tgruntime.trainer import warm_up

    class _Engine:
        settings: Any = None

    monkeypatch.setattr(warm_up, "compiled_fusions", lambda settings: True)
    assert warm_up.wanted(_Engine())  # type: ignore[arg-type]
    monkeypatch.setenv("TG_WARM_UP", "0")
    assert not warm_up.wanted(_Engine())  # type: ignore[arg-type]
    monkeypatch.delenv("TG_WARM_UP")
    monkeypatch.setattr(warm_up, "compiled_fusions", lambda settings: False)  # CPU
    assert not warm_up.wanted(_Engine())  # type: ignore[arg-type]


@pytest.mark.megatron
def test_the_warm_up_leaves_the_engine_as_it_was() -> None:
    pytest.importorskip("megatron.core")
    from tests.trainer import warm_up_scenarios
    from tgruntime.trainer.launch import launch

    blobs = launch(warm_up_scenarios.warm_up_suite, world_size=2, timeout_s=600)
    for rank in [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]:
        assert rank["seconds"] > 0
        assert rank["params_equal"] and rank["step_equal"] and rank["rng_equal"], rank
        assert rank["optim_tensors"] > 0 and rank["optim_equal"], rank
        assert rank["grads_equal"], rank  # nothing accumulated: the next gradient is the same


@pytest.mark.megatron
def test_a_lora_groups_warm_up_takes_the_one_shot_samplers_path() -> None:
    """On a LoRA group the warm-up generates through the active run's one-slot stack (the path
    of ``sample(weights=None)``, whose lean step would otherwise compile at the first call): one
    stack built there, the first ``sample`` refills it and builds none; the run's adapters and
    hooks are as before."""
    pytest.importorskip("megatron.core")
    from tests.trainer import warm_up_scenarios
    from tgruntime.trainer.launch import launch

    blobs = launch(warm_up_scenarios.warm_up_lora_suite, world_size=2, timeout_s=600)
    for rank in [torch.load(io.BytesIO(b), weights_only=False) for b in blobs]:
        assert rank["seconds"] > 0
        assert rank["builds_after_warm_up"] == 1, rank
        assert rank["builds_after_sample"] == 1 and rank["refills_after_sample"] >= 1, rank
        assert rank["hooks_attached"] and rank["adapters_equal"], rank
