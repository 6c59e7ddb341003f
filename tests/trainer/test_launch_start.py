"""tgruntime.trainer.launch picks how ranks start: forked from a preloaded fork server on a
CPU-only machine, spawned where NVIDIA devices are (a fork after megatron-core's import has
initialised CUDA fails with "CUDA error: initialization error")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tgruntime.trainer import launch


def test_cpu_only_forks_gpu_spawns_and_the_setting_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TG_LAUNCH_START", raising=False)
    monkeypatch.setattr(launch, "_dev_names", lambda: ["null", "nvme0", "nvidia-uvm"])
    assert launch.start_method() == "forkserver"
    monkeypatch.setattr(launch, "_dev_names", lambda: ["null", "nvidia0", "nvidia1"])
    assert launch.start_method() == "spawn"
    monkeypatch.setattr(launch, "_dev_names", lambda: ["nvidiactl"])
    assert launch.start_method() == "spawn"
    monkeypatch.setenv("TG_LAUNCH_START", "forkserver")
    assert launch.start_method() == "forkserver"
    monkeypatch.setenv("TG_LAUNCH_START", "fork")
    with pytest.raises(ValueError, match="TG_LAUNCH_START must be spawn or forkserver"):
        launch.start_method()


def test_this_machine_matches_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TG_LAUNCH_START", raising=False)
    has_gpu = Path("/dev/nvidiactl").exists()
    assert launch.start_method() == ("spawn" if has_gpu else "forkserver")
