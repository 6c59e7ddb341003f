"""Every loss the trainer knows, for the callers that look one up by name.

The built-in losses (:mod:`tgruntime.trainer.losses`, which also holds the registry) and
Tinker's (:mod:`tgruntime.trainer.tinker_losses`, which registers into it) are both registered
once this module is imported. ``losses`` never imports ``tinker_losses`` (that was a cycle).
"""

from __future__ import annotations

from tgruntime.trainer import tinker_losses as _tinker_losses  # noqa: F401 - registers them
from tgruntime.trainer.losses import LossFn, registered_losses, resolve_loss

__all__ = ["LossFn", "registered_losses", "resolve_loss"]
