"""LoRA adapters for megatron's tensor-parallel linears (one adapter per megatron linear).

An adapter holds peft's per-projection ``A`` (``[rank, in]``) and ``B`` (``[out, rank]``)
matrices of the Hugging Face projections the megatron linear fuses, and adds
``scaling * B @ A @ x`` to the linear's output in megatron's own (fused, sharded) layout:

* column-parallel (``linear_qkv``, ``linear_fc1``, ``output_layer``): the input is full on
  every tensor rank; each ``A`` is replicated, each ``B`` holds this rank's output rows.
  ``A x`` goes through megatron's ``copy_to_tensor_model_parallel_region`` (identity forward,
  all-reduce backward) so ``A``'s gradient sums every rank's rows.
* row-parallel (``linear_proj``, ``linear_fc2``): the input is sharded on its last dim;
  ``A`` holds this rank's input columns, ``B`` is replicated; the partial ``A x`` is summed
  by ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward).

Fused layouts: ``linear_qkv``'s rows are per key/value group ``[its query heads; its key
head; its value head]`` (``hf_weights``), and a tensor rank holds whole groups (the number
of groups must be a multiple of the tensor-parallel size), so ``B_q``/``B_k``/``B_v`` are
sharded by group and their deltas interleaved per group. ``linear_fc1`` holds
``[gate rows of this rank; up rows of this rank]``.

Adapter parameters are float32 whatever the model's dtype; the forward casts them to the
input's dtype (bf16 on a GPU: the base's own matmul precision; float32 on the CPU), so the
gradients reach float32 tensors. They carry megatron's tensor-parallel attributes, so the
trainer's global grad norm counts each replicated one once.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    set_tensor_model_parallel_attributes,
)

__all__ = ["COLUMN", "FUSE_GATED", "FUSE_NONE", "FUSE_QKV", "ROW", "LinearLora", "Part"]

COLUMN, ROW = "column", "row"
FUSE_NONE, FUSE_QKV, FUSE_GATED = "none", "qkv", "gated"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Part:
    """One Hugging Face projection inside a megatron linear (full, unsharded sizes)."""

    hf_module: str  # e.g. "model.layers.3.self_attn.q_proj" (global layer number)
    in_features: int
    out_features: int


def initial_a(*, hf_module: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The full ``A`` of ``hf_module`` at initialisation: peft's default distribution
    (``kaiming_uniform_(a=sqrt(5))``: uniform in ``+-1/sqrt(in_features)``) from a generator
    seeded by ``seed`` and the module's name, so every layout (TP/PP) starts the same."""
    gen = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(hf_module.encode())) % (2**63)
    )
    bound = 1.0 / math.sqrt(in_features)
    return (
        (torch.rand(rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1)
        .mul_(bound)
        .float()
    )


def _key(hf_module: str) -> str:
    return hf_module.rsplit(".", 1)[-1]  # q_proj, gate_proj, lm_head, ...


class LinearLora(torch.nn.Module):
    """The adapters of one megatron linear; ``forward(x)`` is the delta to add to its output."""

    def __init__(
        self,
        *,
        kind: str,
        fuse: str,
        parts: list[Part],
        rank: int,
        scaling: float,
        seed: int,
        tp_size: int,
        tp_rank: int,
        device: torch.device,
        heads_per_group: int = 1,
        head_dim: int = 1,
        initialize: bool = True,
    ) -> None:
        """``initialize=False``: the parameters are left unset (``torch.empty``), for a
        caller that loads a state into them next (a sampling snapshot's adapters): no draw
        on the host and no host-to-device copy."""
        super().__init__()
        if kind not in (COLUMN, ROW):
            raise ValueError(f"kind must be {COLUMN!r} or {ROW!r}, not {kind!r}")
        expected = {FUSE_NONE: 1, FUSE_QKV: 3, FUSE_GATED: 2}[fuse]
        if len(parts) != expected:
            raise ValueError(f"a {fuse!r} adapter has {expected} parts, got {len(parts)}")
        self.kind, self.fuse, self.parts = kind, fuse, list(parts)
        self.rank, self.scaling = rank, scaling
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.heads_per_group, self.head_dim = heads_per_group, head_dim
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for part in parts:
            if kind == ROW:
                a_cols = self._local(part.in_features, what=f"{part.hf_module} input")
                b_rows = part.out_features
            else:
                a_cols = part.in_features
                b_rows = self._local(part.out_features, what=f"{part.hf_module} output")
            if initialize:
                a = initial_a(
                    hf_module=part.hf_module, rank=rank, in_features=part.in_features, seed=seed
                )
                if kind == ROW:
                    a = self._shard(a, dim=1, what=f"{part.hf_module} input")
                a = a.to(device).contiguous()
                b = torch.zeros(b_rows, rank, device=device)
            else:
                a = torch.empty(rank, a_cols, device=device)
                b = torch.empty(b_rows, rank, device=device)
            key = _key(part.hf_module)
            self.lora_A[key] = torch.nn.Parameter(a)
            self.lora_B[key] = torch.nn.Parameter(b)
            sharded_a, sharded_b = kind == ROW, kind == COLUMN
            for param, sharded, dim in (
                (self.lora_A[key], sharded_a, 1),
                (self.lora_B[key], sharded_b, 0),
            ):
                set_tensor_model_parallel_attributes(param, sharded and tp_size > 1, dim, 1)

    # -- sharding ----------------------------------------------------------------------
    def _local(self, size: int, *, what: str) -> int:
        if size % self.tp_size:
            raise ValueError(f"{what} size {size} does not split over TP size {self.tp_size}")
        return size // self.tp_size

    def _shard(self, full: torch.Tensor, *, dim: int, what: str) -> torch.Tensor:
        self._local(full.shape[dim], what=what)
        return torch.chunk(full, self.tp_size, dim=dim)[self.tp_rank].contiguous()

    def split_dim(self, which: str) -> int | None:
        """The dim ``lora_A``/``lora_B`` (``which`` "A"/"B") is sharded on (None: replicated)."""
        if self.tp_size == 1:
            return None
        if which == "A":
            return 1 if self.kind == ROW else None
        return 0 if self.kind == COLUMN else None

    def local_shard(self, which: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full ``A``/``B`` (as :meth:`split_dim` says)."""
        dim = self.split_dim(which)
        return full.contiguous() if dim is None else self._shard(full, dim=dim, what=which)

    # -- compute -----------------------------------------------------------------------
    def _combine(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Per-part outputs (last dim: this rank's rows of each) -> the fused local layout."""
        if self.fuse == FUSE_NONE:
            return pieces[0]
        if self.fuse == FUSE_GATED:
            return torch.cat(pieces, dim=-1)
        q, k, v = pieces
        lead = q.shape[:-1]
        groups = k.shape[-1] // self.head_dim
        grouped = torch.cat(
            [
                q.reshape(*lead, groups, self.heads_per_group * self.head_dim),
                k.reshape(*lead, groups, self.head_dim),
                v.reshape(*lead, groups, self.head_dim),
            ],
            dim=-1,
        )
        return grouped.reshape(*lead, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B @ A @ x`` in the megatron linear's local output layout, in ``x``'s
        dtype: the float32 adapters are cast to it (bf16 on a GPU: tensor-core matmuls, as
        the base's own; their gradients are float32 again through the cast)."""
        dtype = x.dtype
        keys = [_key(part.hf_module) for part in self.parts]
        a = torch.cat([self.lora_A[k] for k in keys]).to(dtype)  # parts share the input
        h = torch.matmul(x, a.t())  # [..., parts x rank]: one matmul for q/k/v or gate/up
        if self.kind == COLUMN:
            h = copy_to_tensor_model_parallel_region(h)
        else:
            h = reduce_from_tensor_model_parallel_region(h)
        pieces = [
            torch.matmul(hp, self.lora_B[k].to(dtype).t())
            for hp, k in zip(torch.split(h, self.rank, dim=-1), keys, strict=True)
        ]
        return self._combine(pieces) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` as this rank's shard of the megatron weight ([out_l, in_l])."""
        pieces = [
            (self.lora_B[_key(p.hf_module)] @ self.lora_A[_key(p.hf_module)]).t()
            for p in self.parts
        ]  # each [in_l, out_l]: rows of the delta as an "output" on the last dim
        return (self._combine(pieces) * self.scaling).t().contiguous()

    def extra_repr(self) -> str:
        names = ", ".join(_key(p.hf_module) for p in self.parts)
        return f"{self.kind}, parts=[{names}], rank={self.rank}, scaling={self.scaling:g}"
