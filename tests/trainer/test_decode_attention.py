"""The sampler's Triton decode-attention kernel against indexed writes + masked SDPA.

The kernel runs under Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, read when
Triton compiles a kernel, so each case runs in a fresh interpreter process). Float32 inputs,
fresh random data per case, caches poisoned with random values beyond each row's position
(a kernel that read past ``pos[r]`` would differ), rows at position 0 and at the last
position of the cache, grouped query heads (1, 3 and 4 per key/value group), a query that is
a strided view of a fused QKV tensor (as the projection leaves it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the decode-attention kernel is written in Triton")

_CASE = r"""
import json, sys, torch
from tgruntime.trainer.sampling.decode_attention import decode_attention, kernel_applies, reference
b, g, h, d, length, seed = (int(x) for x in sys.argv[1:7])
torch.manual_seed(seed)
qkv = torch.randn(b, g, h + 2, d)
q, k, v = qkv[:, :, :h], qkv[:, :, h], qkv[:, :, h + 1]
k_cache, v_cache = torch.randn(b, g, length, d), torch.randn(b, g, length, d)
pos = torch.randint(0, length, (b,))
pos[0], pos[-1] = 0, length - 1
k_ref, v_ref = k_cache.clone(), v_cache.clone()
out = decode_attention(q, k, v, k_cache, v_cache, pos, 0.25)
want = reference(q, k, v, k_ref, v_ref, pos, 0.25)
print(json.dumps({
    "kernel": kernel_applies(q),
    "out": float((out - want).abs().max() / want.abs().max()),
    "keys": float((k_cache - k_ref).abs().max()),
    "values": float((v_cache - v_ref).abs().max()),
    "finite": bool(torch.isfinite(out).all()),
}))
"""

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("b", "g", "h", "d", "length"),
    [(3, 2, 1, 16, 40), (4, 2, 4, 32, 130), (2, 1, 3, 64, 65)],
    ids=["mha", "gqa4-two-blocks", "gqa3-block-edge"],
)
def test_kernel_equals_masked_sdpa(b: int, g: int, h: int, d: int, length: int) -> None:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "runtime"), str(ROOT / "api"), os.environ.get("PYTHONPATH", "")]
        ),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", _CASE, *map(str, (b, g, h, d, length, b * 7 + h))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["kernel"], r  # the kernel ran, not the reference
    assert r["finite"] and r["out"] < 1e-5, r
    assert r["keys"] == 0.0 and r["values"] == 0.0, r  # the new key/value written, nothing else


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "d", "length"), [(1, 128, 384), (4, 128, 1000), (2, 64, 70)])
def test_kernel_on_gpu_in_bf16(h: int, d: int, length: int) -> None:
    """On a GPU in bf16: the compiled kernel against masked SDPA over float32 copies."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (runs on the lent GPU: bench/gpu/pytest_on_device.sh)")
    from tgruntime.trainer.sampling.decode_attention import (
        decode_attention,
        kernel_applies,
        reference,
    )

    torch.manual_seed(h * 1000 + length)
    b, g = 32, 8
    qkv = torch.randn(b, g, h + 2, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, :h], qkv[:, :, h], qkv[:, :, h + 1]
    caches = [torch.randn(b, g, length, d, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    pos = torch.randint(0, length, (b,), device="cuda")
    pos[0], pos[-1] = 0, length - 1
    ref_caches = [c.float() for c in caches]
    assert kernel_applies(q)
    out = decode_attention(q, k, v, caches[0], caches[1], pos, d**-0.5)
    want = reference(q.float(), k.float(), v.float(), ref_caches[0], ref_caches[1], pos, d**-0.5)
    torch.cuda.synchronize()
    err = float((out.float() - want).norm() / want.norm())
    assert torch.isfinite(out).all() and err < 1e-2, err
    assert torch.equal(caches[0].float(), ref_caches[0]) and torch.equal(
        caches[1].float(), ref_caches[1]
    )
