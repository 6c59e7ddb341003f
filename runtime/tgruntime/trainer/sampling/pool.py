"""``PoolConfig``: the size of the continuous engine's KV pool (slots x positions), checked.

The pool is allocated once, when the engine first runs: ``slots`` rows of ``length``
positions, per layer keys and values of this rank's key/value heads. Its size comes from
the arguments of ``sampler_pool`` (the service passes its flags), else the environment
(``TG_SAMPLER_SLOTS``, ``TG_SAMPLER_SLOT_LENGTH``, ``TG_SAMPLER_KV_BYTES``), else the
defaults: 64 slots, the model's ``maxSequenceLength`` positions, and on a GPU a byte budget
of a quarter of the free device memory (no budget on the CPU). The slots are cut to what the
budget holds; a budget that holds no row is refused with the numbers.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["DEFAULT_SLOTS", "PoolConfig", "PoolSize"]

DEFAULT_SLOTS = 64
GPU_SHARE = 0.25  # of the free device memory, when no budget is given


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """What was asked for (None: the environment, else the default)."""

    slots: int | None = None
    length: int | None = None
    kv_bytes: int | None = None

    @classmethod
    def from_env(cls) -> PoolConfig:
        def read(name: str) -> int | None:
            raw = os.environ.get(name)
            if raw is None or raw == "":
                return None
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} must be an integer") from None

        return cls(
            slots=read("TG_SAMPLER_SLOTS"),
            length=read("TG_SAMPLER_SLOT_LENGTH"),
            kv_bytes=read("TG_SAMPLER_KV_BYTES"),
        )

    def merged(self, other: PoolConfig) -> PoolConfig:
        """These values, ``other``'s where these are None."""
        return PoolConfig(
            slots=self.slots if self.slots is not None else other.slots,
            length=self.length if self.length is not None else other.length,
            kv_bytes=self.kv_bytes if self.kv_bytes is not None else other.kv_bytes,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSize:
    slots: int
    length: int
    row_bytes: int  # KV bytes of one slot on this rank
    budget: int | None  # bytes, None = no budget

    @property
    def nbytes(self) -> int:
        return self.slots * self.row_bytes

    @classmethod
    def resolve(
        cls,
        config: PoolConfig,
        *,
        max_sequence_length: int,
        bytes_per_position: int,
        free_bytes: int | None,
    ) -> PoolSize:
        """The pool for ``config`` (``bytes_per_position``: one row's KV per position, all
        layers, this rank; ``free_bytes``: free device memory, None on the CPU)."""
        slots = DEFAULT_SLOTS if config.slots is None else config.slots
        length = max_sequence_length if config.length is None else config.length
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"sampler pool: slots must be an integer >= 1, not {slots!r}")
        if not isinstance(length, int) or not 2 <= length <= max_sequence_length:
            raise ValueError(
                f"sampler pool: length (positions per slot) must be in [2, "
                f"model.maxSequenceLength {max_sequence_length}], not {length!r}"
            )
        budget = config.kv_bytes
        if budget is None and free_bytes is not None:
            budget = int(free_bytes * GPU_SHARE)
        row_bytes = length * bytes_per_position
        if budget is not None:
            if budget < row_bytes:
                raise ValueError(
                    f"sampler pool: the KV budget of {budget:,} bytes holds no row: one slot of "
                    f"{length} positions needs {row_bytes:,} bytes on this rank; raise kv_bytes "
                    f"(TG_SAMPLER_KV_BYTES) or lower length (TG_SAMPLER_SLOT_LENGTH)"
                )
            slots = min(slots, budget // row_bytes)
        return cls(slots=slots, length=length, row_bytes=row_bytes, budget=budget)
