"""``LoraSettings``: what a LoRA run trains (the Tinker SDK's ``LoraConfig``, plus ``alpha``).

The fields mirror ``tinker.types.LoraConfig`` (``rank``, ``seed``, ``train_attn``,
``train_mlp``, ``train_unembed``; the SDK's ``create_lora_training_client`` defaults to rank
32 and all three switches on). ``alpha`` is ours: the SDK does not expose it; the update is
scaled by ``alpha / rank`` as in ``peft``'s default (not rsLoRA), and the default ``alpha``
32 makes rank 32 a scale of 1.

Rank 0 means no adapters at all (a full-weight run); then every switch must be off.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tgruntime.trainer.hf_weights import LlamaShape

__all__ = ["DEFAULT_ALPHA", "DEFAULT_RANK", "LoraSettings", "TargetShape"]

DEFAULT_RANK = 32  # tinker's create_lora_training_client(rank=32) and the cookbook's default
DEFAULT_ALPHA = 32.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetShape:
    """One Hugging Face projection an adapter wraps: its name inside a layer and full sizes."""

    name: str  # e.g. "self_attn.q_proj", or "lm_head" outside the layers
    in_features: int
    out_features: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSettings:
    """A LoRA adapter's configuration (validated on construction)."""

    rank: int = DEFAULT_RANK
    alpha: float = DEFAULT_ALPHA
    seed: int = 0  # initialisation of A (B starts at zero)
    train_attn: bool = True  # q_proj, k_proj, v_proj, o_proj
    train_mlp: bool = True  # gate_proj, up_proj, down_proj
    train_unembed: bool = True  # lm_head

    def __post_init__(self) -> None:
        for name in ("train_attn", "train_mlp", "train_unembed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"lora.{name} must be true or false, not {getattr(self, name)!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"lora.rank must be an integer, not {self.rank!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"lora.seed must be an integer, not {self.seed!r}")
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 1 (or 0 for no adapters), not {self.rank}")
        switches = [n for n in ("train_attn", "train_mlp", "train_unembed") if getattr(self, n)]
        if self.rank == 0 and switches:
            raise ValueError(
                f"lora.rank is 0 (no adapters: full-weight training) but {', '.join(switches)} "
                "asks for adapters; set lora.rank >= 1, or turn those switches off"
            )
        if self.rank > 0 and not switches:
            raise ValueError(
                f"lora.rank is {self.rank} but train_attn, train_mlp and train_unembed are all "
                "false: nothing to adapt; turn at least one on (or set lora.rank 0)"
            )
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
            raise ValueError(f"lora.alpha must be a number > 0, not {alpha!r}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """``alpha / rank``: peft's default scaling of ``B @ A``."""
        return float(self.alpha) / self.rank if self.rank else 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> LoraSettings:
        """From a dict (e.g. the SDK's ``LoraConfig`` fields); unknown keys are refused.

        ``seed: None`` (the SDK's "random") becomes 0: adapters here are always reproducible.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"lora: unknown field {', '.join(map(repr, unknown))}; "
                f"known fields: {', '.join(sorted(known))}"
            )
        kwargs = dict(values)
        if kwargs.get("seed", 0) is None:
            kwargs["seed"] = 0
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hf_targets(self) -> list[str]:
        """peft's ``target_modules`` for these switches (Hugging Face module names)."""
        out: list[str] = []
        if self.train_attn:
            out += ["q_proj", "k_proj", "v_proj", "o_proj"]
        if self.train_mlp:
            out += ["gate_proj", "up_proj", "down_proj"]
        if self.train_unembed:
            out.append("lm_head")
        return out

    def targets(self, shape: LlamaShape) -> list[TargetShape]:
        """The projections adapted in each layer (and ``lm_head``), with their full sizes."""
        h, f, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
        q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
        sizes = {
            "q_proj": ("self_attn.q_proj", h, q),
            "k_proj": ("self_attn.k_proj", h, kv),
            "v_proj": ("self_attn.v_proj", h, kv),
            "o_proj": ("self_attn.o_proj", q, h),
            "gate_proj": ("mlp.gate_proj", h, f),
            "up_proj": ("mlp.up_proj", h, f),
            "down_proj": ("mlp.down_proj", f, h),
            "lm_head": ("lm_head", h, shape.vocab_size),
        }
        return [
            TargetShape(name=sizes[t][0], in_features=sizes[t][1], out_features=sizes[t][2])
            for t in self.hf_targets()
        ]

    def parameter_count(self, shape: LlamaShape) -> int:
        """Adapter parameters of the whole model (all stages, unsharded): ``rank * (in + out)``
        per adapted projection, per layer (``lm_head`` once)."""
        if not self.enabled:
            return 0
        total = 0
        for target in self.targets(shape):
            per = self.rank * (target.in_features + target.out_features)
            total += per if target.name == "lm_head" else per * shape.num_layers
        return total

    def check_shape(self, shape: LlamaShape) -> None:
        """Refuse a rank no adapted projection can hold (beyond its input or output size)."""
        if not self.enabled:
            return
        if self.rank > shape.hidden_size:
            raise ValueError(
                f"lora.rank {self.rank} is beyond the model's hidden size {shape.hidden_size}; "
                f"use lora.rank <= {shape.hidden_size} (typically 8 to 64)"
            )
        for target in self.targets(shape):
            limit = min(target.in_features, target.out_features)
            if self.rank > limit:
                raise ValueError(
                    f"lora.rank {self.rank} is beyond {target.name}'s size "
                    f"({target.in_features} -> {target.out_features}); use lora.rank <= {limit}"
                    " or turn off the switch that adapts it"
                )
