"""Training progress: what the trainer's rank 0 records in the group record after each step.

The ``training`` object of the group record (Ray's internal KV, docs/contracts.md): the
last optimizer step, its loss, gradient norm and throughput, when it ended, and how many
training runs the group holds. ``tgctl status`` shows it.

The operator never imports Ray, so it cannot read the KV: rank 0 also keeps the same object,
one JSON line, in a file under its node's Ray log directory (:func:`progress_filename`), which
the operator reads through the dashboard's log API (``GET /api/v0/logs/file``). Pure (standard
library only), camelCase on the wire like every other payload.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_LISTED_RUNS",
    "RunProgress",
    "TrainingProgress",
    "describe_age",
    "parse_progress_file",
    "progress_filename",
]

PROGRESS_DIR = "trainergroup"
"""The folder, under the Ray log directory of rank 0's node, of the groups' progress files."""


def _finite(value: Any) -> float | None:
    """A float, or None for None / NaN / inf (strict JSON has no non-finite numbers)."""
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunProgress:
    """One training run of a LoRA group (many runs on one base; docs/lora.md)."""

    run_id: str
    steps: int
    last_active: float
    """When the run last trained, sampled or saved, seconds since the epoch."""

    def to_wire(self) -> dict[str, Any]:
        return {"id": self.run_id, "steps": self.steps, "lastActive": self.last_active}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RunProgress:
        return cls(
            run_id=str(data["id"]),
            steps=int(data.get("steps", 0)),
            last_active=float(data.get("lastActive") or 0.0),
        )


MAX_LISTED_RUNS = 32
"""At most this many runs are listed (the most recently active), whatever ``runs`` says."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingProgress:
    """The last optimizer step of a group, as its rank 0 saw it."""

    step: int
    """Optimizer steps taken so far (it continues across a resume)."""
    loss: float | None = None
    """Mean loss of the step over the global batch; None when not finite."""
    grad_norm: float | None = None
    """Global L2 norm of the gradient before clipping; None when not finite."""
    tokens_per_s: float | None = None
    """Tokens of the global batch per second of the step's wall time."""
    last_step_at: float = 0.0
    """When the step ended, seconds since the epoch (the writer's clock)."""
    runs: int = 1
    """Training runs in the group (1: the group's own model)."""
    run_list: tuple[RunProgress, ...] = ()
    """A LoRA group's runs (id, steps, last activity); empty for a group of one run."""

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "loss": _finite(self.loss),
            "gradNorm": _finite(self.grad_norm),
            "tokensPerSecond": _finite(self.tokens_per_s),
            "lastStepAt": self.last_step_at,
            "runs": self.runs,
        }
        if self.run_list:  # a LoRA group's runs
            out["runList"] = [r.to_wire() for r in self.run_list]
        return out

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> TrainingProgress:
        """From the wire object; missing keys take their defaults, unknown keys are ignored.

        ValueError when ``step`` is missing or a value has the wrong type.
        """
        if "step" not in data:
            raise ValueError("training progress: key 'step' is missing")
        try:
            return cls(
                step=int(data["step"]),
                loss=_finite(data.get("loss")),
                grad_norm=_finite(data.get("gradNorm")),
                tokens_per_s=_finite(data.get("tokensPerSecond")),
                last_step_at=float(data.get("lastStepAt") or 0.0),
                runs=int(data.get("runs", 1)),
                run_list=tuple(RunProgress.from_wire(r) for r in data.get("runList") or ()),
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"training progress: {exc}") from exc

    def age_s(self, now: float) -> float:
        """Seconds since the last step at ``now`` (epoch seconds); never negative."""
        return max(0.0, now - self.last_step_at)


def describe_age(seconds: float) -> str:
    """``12 s ago``, ``5 min ago``, ``3 h ago``, ``2 d ago``."""
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s ago"
    if s < 2 * 3600:
        return f"{s // 60} min ago"
    if s < 2 * 86400:
        return f"{s // 3600} h ago"
    return f"{s // 86400} d ago"


def progress_filename(*, ray_namespace: str, group_name: str) -> str:
    """The progress file of one group, relative to the Ray log directory of rank 0's node
    (the ``filename`` of the dashboard's log API)."""
    return f"{PROGRESS_DIR}/progress.{ray_namespace}.{group_name}.json"


def parse_progress_file(text: str) -> TrainingProgress | None:
    """The progress in a progress file's text (its last non-empty line); None when the text
    holds no valid progress object (empty, cut off, not JSON, no ``step``)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        data = json.loads(lines[-1])
        return TrainingProgress.from_wire(data) if isinstance(data, Mapping) else None
    except ValueError:
        return None
