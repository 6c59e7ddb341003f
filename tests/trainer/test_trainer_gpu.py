"""The trainer on a GPU (NCCL, bf16, RoPE, megatron's schedule/DDP/optimizer); skipped
without CUDA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.trainer import scenarios

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]


def test_gpu_bf16_trains_and_resumes(tmp_path: Path) -> None:
    from tgruntime.trainer.launch import launch

    (run,) = launch(
        scenarios.gpu_train_and_resume,
        world_size=1,
        kwargs={"checkpoint_dir": str(tmp_path)},
        timeout_s=300,
    )
    mesh = run["mesh"]
    assert (mesh["backend"], mesh["dtype"], mesh["position_embedding"]) == (
        "nccl",
        "bfloat16",
        "rope",
    )
    losses = run["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses
    assert run["loaded"] == 3
    # bf16 kernels may reorder reductions: close, not bitwise
    assert run["resumed"] == pytest.approx(losses[3:], rel=2e-2), (run["resumed"], losses)
