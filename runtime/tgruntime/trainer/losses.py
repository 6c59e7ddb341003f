"""Training losses for ``forward_backward``: a registry of pure functions over log-probs.

A loss is ``fn(log_probs, batch, config) -> (per_token_loss, metrics)``:

- ``log_probs``: float32 ``[b, T]`` (``T = S - 1``), ``log_probs[:, j]`` is
  ``log p(input_ids[:, j + 1] | input_ids[:, :j + 1])``, differentiable;
- ``batch``: the micro-batch's per-token tensors, each ``[b, T]`` aligned with ``log_probs``
  (``loss_mask`` always; ``advantages``, ``old_log_probs``, ``ref_log_probs``... as sent);
  a missing key raises :class:`MissingTensorError` naming the key and the fix;
- ``config``: the call's ``loss_config`` dict;
- returns the unreduced loss per token ``[b, T]`` and metrics, each a per-token ``[b, T]``
  tensor or a scalar.

The trainer, not the loss, reduces: loss and metrics are weighted by ``loss_mask`` and
normalised by the sum of ``loss_mask`` over every micro-batch, data-parallel rank and
accumulated call (a token mean over everything since the last optimizer step; see
docs/trainer.md). A float ``loss_mask`` is a per-token weight.

Users add losses with :func:`register_loss` (in a module the workers import), by passing
``loss="package.module:function"`` (imported on the workers), or by passing the function
itself (Ray pickles it by value when it is defined in ``__main__``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from tgapi.errors import PicklableError

__all__ = [
    "LossFn",
    "LossSpec",
    "MissingTensorError",
    "TokenTensors",
    "check_loss_output",
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "register_loss",
    "registered_losses",
    "resolve_loss",
]

Metrics = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, "TokenTensors", Mapping[str, Any]], tuple[torch.Tensor, Metrics]]

TENSOR_DOCS: dict[str, str] = {
    "advantages": "float [B, S-1] per-token advantages",
    "old_log_probs": "float [B, S-1] the sampler's log-probs of the same tokens",
    "ref_log_probs": "float [B, S-1] the reference policy's log-probs (for kl_coef > 0)",
    "loss_mask": "float [B, S-1] per-token weights (1 = train on this token)",
}


class MissingTensorError(PicklableError, KeyError):
    """A loss asked for a per-token tensor the DataProto does not hold."""

    def __init__(self, *, key: str, loss: str, present: list[str]) -> None:
        what = TENSOR_DOCS.get(key, "float [B, S-1], aligned with log_probs")
        self.message = (
            f"loss {loss!r} needs batch[{key!r}] ({what}); the DataProto holds {present}: "
            f"add it with DataProto.from_dict(tensors={{..., {key!r}: ...}})"
        )
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class TokenTensors(Mapping[str, torch.Tensor]):
    """Read-only per-token tensors of one micro-batch; a missing key says what to send."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, loss: str) -> None:
        self._tensors = dict(tensors)
        self._loss = loss

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise MissingTensorError(key=key, loss=self._loss, present=sorted(self)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSpec:
    name: str
    fn: LossFn
    required: tuple[str, ...] = ()  # checked before any computation, on every rank

    def check(self, present: list[str]) -> None:
        for key in self.required:
            if key not in present:
                raise MissingTensorError(key=key, loss=self.name, present=sorted(present))


def _config_float(config: Mapping[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"loss_config[{key!r}] must be a number, got {value!r}")
    return float(value)


def cross_entropy(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """Supervised next-token loss: ``-log p(token)`` on the tokens ``loss_mask`` selects."""
    return -log_probs, {}


def importance_sampling(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """Off-policy policy gradient: ``-exp(logp - old_logp) * A`` per token (no clipping)."""
    ratio = torch.exp(log_probs - batch["old_log_probs"].float())
    advantages = batch["advantages"].float()
    return -ratio * advantages, {"ratio": ratio.detach()}


def ppo(
    log_probs: torch.Tensor, batch: TokenTensors, config: Mapping[str, Any]
) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped surrogate, plus ``kl_coef`` x KL to ``ref_log_probs`` when kl_coef > 0.

    ``loss = max(-A * r, -A * clip(r, 1 - clip_eps, 1 + clip_eps_high))``, ``r =
    exp(logp - old_logp)``; ``clip_eps`` default 0.2, ``clip_eps_high`` default clip_eps.
    KL estimator ``kl_estimator``: ``"k3"`` (default; ``exp(ref - logp) - (ref - logp) - 1``,
    >= 0, unbiased) or ``"k1"`` (``logp - ref``).
    """
    low = _config_float(config, "clip_eps", 0.2)
    high = _config_float(config, "clip_eps_high", low)
    kl_coef = _config_float(config, "kl_coef", 0.0)
    if low < 0 or high < 0:
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {low} and {high}")
    advantages = batch["advantages"].float()
    ratio = torch.exp(log_probs - batch["old_log_probs"].float())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    metrics: Metrics = {
        "ratio": ratio.detach(),
        "clip_frac": (clipped > unclipped).float().detach(),
    }
    if kl_coef > 0:
        kl = kl_divergence(log_probs, batch["ref_log_probs"].float(), config)
        loss = loss + kl_coef * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


def kl_divergence(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, config: Mapping[str, Any]
) -> torch.Tensor:
    estimator = config.get("kl_estimator", "k3")
    delta = ref_log_probs - log_probs
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    if estimator == "k1":
        return -delta
    raise ValueError(f"loss_config['kl_estimator'] must be 'k1' or 'k3', got {estimator!r}")


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(
    name: str, fn: LossFn, *, required: tuple[str, ...] = (), replace: bool = False
) -> None:
    """Make ``fn`` available as ``forward_backward(data, loss=name)`` in this process.

    ``required``: per-token tensors the loss reads (checked up front, with a clear error).
    Register in a module the workers import (or pass ``loss="module:function"``).
    """
    if not name or not isinstance(name, str):
        raise ValueError("register_loss needs a non-empty name")
    if not callable(fn):
        raise TypeError(f"register_loss({name!r}, fn): fn must be callable, got {fn!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"loss {name!r} is already registered; pass replace=True to override")
    _REGISTRY[name] = LossSpec(name=name, fn=fn, required=tuple(required))


def registered_losses() -> list[str]:
    return sorted(_REGISTRY)


def check_loss_output(spec: LossSpec, out: Any, shape: tuple[int, ...]) -> None:
    """The loss returned ``(per_token [b, T], {name: tensor})``; else a clear error."""
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)
    if not ok or not isinstance(out[0], torch.Tensor):
        raise TypeError(
            f"loss {spec.name!r} must return (per_token_loss, metrics_dict), got "
            f"{type(out).__name__}"
        )
    if tuple(out[0].shape) != shape:
        raise ValueError(
            f"loss {spec.name!r} returned a per-token loss of shape {tuple(out[0].shape)}; "
            f"it must be [b, S-1] = {list(shape)} (unreduced: the trainer reduces)"
        )
    for key, value in out[1].items():
        if not isinstance(value, torch.Tensor) or value.dim() not in (0, 2):
            raise ValueError(
                f"loss {spec.name!r}: metric {key!r} must be a scalar or a [b, S-1] tensor"
            )


def resolve_loss(loss: str | LossFn) -> LossSpec:
    """A registered name, ``"module:function"`` (imported here), or a callable."""
    if callable(loss):
        name = getattr(loss, "__qualname__", type(loss).__name__)
        return LossSpec(name=name, fn=loss)
    if not isinstance(loss, str):
        raise TypeError(f"loss must be a name or a callable, got {type(loss).__name__}")
    found = _REGISTRY.get(loss)
    if found is not None:
        return found
    if ":" in loss:
        module, _, attr = loss.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(
                f"loss {loss!r}: cannot import {attr!r} from module {module!r} on this worker "
                f"({exc}); install the module where the workers run, or pass the function"
            ) from None
        return LossSpec(name=loss, fn=fn)
    raise ValueError(
        f"unknown loss {loss!r}; registered: {registered_losses()}. Use one of those, "
        "'package.module:function', a callable, or register_loss(name, fn) in a module the "
        "workers import"
    )


register_loss("cross_entropy", cross_entropy)
register_loss("importance_sampling", importance_sampling, required=("advantages", "old_log_probs"))
register_loss("ppo", ppo, required=("advantages", "old_log_probs"))
