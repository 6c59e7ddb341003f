"""Decode attention: write each row's new key/value and attend to its own live positions.

The lean decode step (``lean_layer.py``) used to write the cache with two indexed copies and
call SDPA with a boolean mask over the whole allocated cache: on an H100 at batch 32 (seed
shape) that was about 38% of the step's kernel time (``bench/decode_profile.py``): cuDNN's
attention over every allocated position, a mask converted to an additive one in every
layer, a copy to make the query contiguous, and the two index kernels.

:func:`decode_attention` does the same in one Triton kernel, one program per (row, key/value
group): it stores the row's new key and value at ``pos[r]``, then runs an online softmax
over that row's positions ``[0, pos[r])`` read from the cache, block by block, plus the new
token from registers, for the group's query heads at once (GQA without repeating the cache).
Positions past ``pos[r]`` are never read, so a short row in a long slot costs only its own
length. It reads the query and the new key/value where the QKV projection left them (any
strides, last dimension contiguous) and writes the output in the layout the projection
takes. The loop bound is read on the device, so the step stays free of host
synchronisation and is captured in CUDA graphs as before.

Where the kernel does not apply (no Triton, not CUDA, a head dimension that is not a power
of two up to 256, float32, or ``TG_SAMPLER_ATTENTION=sdpa``), :func:`reference` runs: the
indexed writes and masked SDPA. ``TRITON_INTERPRET=1`` runs the kernel on CPU tensors
(tests/trainer/test_decode_attention.py compares the two that way).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["decode_attention", "kernel_applies", "reference"]

try:  # Triton ships with PyTorch's CUDA wheels; the CPU path does not need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indexed cache writes and SDPA over the whole cache with a ``<= pos`` mask.

    ``q`` ``[b, g, h, d]`` (``h`` query heads per group), ``k``/``v`` ``[b, g, d]``, caches
    ``[b, g, L, d]``, ``pos`` ``[b]`` -> ``[b, g, h, d]``. ``mask`` ``[b, 1, 1, L]``: the
    ``<= pos`` mask when the caller made it once for every layer."""
    b, length = q.shape[0], k_cache.shape[2]
    rows = torch.arange(b, device=q.device)
    k_cache[rows, :, pos] = k
    v_cache[rows, :, pos] = v
    if mask is None:
        span = torch.arange(length, device=pos.device)
        mask = (span.unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, length)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def kernel_applies(q: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` runs the Triton kernel for this query."""
    if triton is None or os.environ.get("TG_SAMPLER_ATTENTION", "") == "sdpa":
        return False
    d = int(q.shape[-1])
    if d & (d - 1) or not 16 <= d <= 256:
        return False
    if _interpreting():
        return q.device.type == "cpu"
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """As :func:`reference`; the Triton kernel where :func:`kernel_applies` (it needs no
    mask: each row's positions are ``[0, pos[r]]``)."""
    if not kernel_applies(q):
        return reference(q, k, v, k_cache, v_cache, pos, scale, mask)
    b, g, h, d = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("decode_attention: the key and value caches need one contiguous layout")
    out = torch.empty((b, g, h, d), dtype=q.dtype, device=q.device)
    _launch(q, k, v, k_cache, v_cache, pos, out, scale)
    return out


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    b, g, h, d = q.shape
    heads_p = max(16, 1 << (h - 1).bit_length())  # tl.dot needs 16 rows at least
    kernel = _kernel()
    kernel[(b, g)](
        q, k, v, k_cache, v_cache, pos, out, float(scale),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HEADS=h, HEADS_P=heads_p, D=d, BLOCK_N=64 if d <= 128 else 32,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )  # fmt: skip


_KERNELS: dict[bool, Any] = {}


def _kernel() -> Any:
    """The kernel, decorated on first use (``triton.jit`` reads ``TRITON_INTERPRET`` when it
    decorates; the interpreter also needs it set before Triton is first imported, so the
    tests run it in a fresh process)."""
    mode = _interpreting()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_decode_kernel)
    return _KERNELS[mode]


if triton is not None:

    def _decode_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, KC, VC, POS, OUT, scale,
        sqb, sqg, sqh,
        skb, skg,
        svb, svg,
        scb, scg, scl,
        sob, sog, soh,
        HEADS: tl.constexpr, HEADS_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        grp = tl.program_id(1)
        p = tl.load(POS + row)
        offs_h = tl.arange(0, HEADS_P)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        live_h = offs_h < HEADS
        q = tl.load(
            Q + row * sqb + grp * sqg + offs_h[:, None] * sqh + offs_d[None, :],
            mask=live_h[:, None],
            other=0.0,
        )
        k_new = tl.load(K + row * skb + grp * skg + offs_d)
        v_new = tl.load(V + row * svb + grp * svg + offs_d)
        base = row * scb + grp * scg
        tl.store(KC + base + p * scl + offs_d, k_new)
        tl.store(VC + base + p * scl + offs_d, v_new)
        # the new token first: it starts the running max, sum and output
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale
        s_sum = tl.full([HEADS_P], 1.0, tl.float32)
        acc = tl.zeros([HEADS_P, D], tl.float32) + v_new.to(tl.float32)[None, :]
        for start in range(0, p, BLOCK_N):
            n = start + offs_n
            live_n = n < p
            kb = tl.load(
                KC + base + n[:, None] * scl + offs_d[None, :], mask=live_n[:, None], other=0.0
            )
            if IEEE:
                s = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(kb)) * scale
            s = tl.where(live_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            weights = tl.exp(s - m_new[:, None])
            s_sum = s_sum * alpha + tl.sum(weights, axis=1)
            vb = tl.load(
                VC + base + n[:, None] * scl + offs_d[None, :], mask=live_n[:, None], other=0.0
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(weights, vb, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(weights.to(vb.dtype), vb)
            m = m_new
        result = acc / s_sum[:, None]
        tl.store(
            OUT + row * sob + grp * sog + offs_h[:, None] * soh + offs_d[None, :],
            result.to(OUT.dtype.element_ty),
            mask=live_h[:, None],
        )
