"""The device time of a stretch of queued work, read without a host sync until it is asked
for (the sampler's timings: ``SlotEngine.info``, ``Sampler.last``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceSpan"]


class DeviceSpan:
    """The device time of the work queued between its start and ``stop`` (CUDA events:
    no host sync; read once the stream got past ``stop``); 0 off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.events: tuple[Any, Any] | None = None
        if device.type == "cuda":
            self.events = (
                torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
                torch.cuda.Event(enable_timing=True),  # type: ignore[no-untyped-call]
            )
            self.events[0].record()

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()

    def seconds(self) -> float:
        if self.events is None:
            return 0.0
        self.events[1].synchronize()
        return float(self.events[0].elapsed_time(self.events[1])) / 1000.0
