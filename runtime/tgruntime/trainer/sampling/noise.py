"""Counter-based Gumbel noise: a pure function of (row key, step, token id).

Sampling by Gumbel-max, ``argmax(z + g)`` with ``g = -log(-log(u))``, draws a token from
``softmax(z)``. Here ``u`` is a hash of the row's key, the decode step and the token id
(a splitmix64-style mixer in int64 tensor arithmetic), not a stateful generator, so:

* a row's tokens depend only on its own key (seed, prompt, sample index), never on the
  other rows in the batch or on how many calls came before;
* every tensor-parallel rank computes the same noise without communicating;
* the step can be a device tensor, so a decode step with sampling can be captured in a
  CUDA graph (no host RNG state, no host synchronisation).
"""

from __future__ import annotations

import torch

__all__ = ["gumbel_noise", "token_salts", "uniform_noise"]


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
_STEP = _signed(0xD1B54A32D192ED03)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def token_salts(vocab: int, device: torch.device) -> torch.Tensor:
    """Each token id's term of the hash, ``(id + 1) * GOLDEN`` (int64 ``[vocab]``). A compiled
    caller passes it in: Inductor folds an ``arange`` into its int32 index arithmetic, where
    the 64-bit constant does not fit (a Triton compile error, torch 2.9)."""
    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GOLDEN


def uniform_noise(
    keys: torch.Tensor, step: torch.Tensor | int, vocab: int, *, salts: torch.Tensor | None = None
) -> torch.Tensor:
    """``u`` in (0, 1), float32 ``[R, vocab]``, from int64 ``keys [R]`` and the decode step
    (one for every row, or ``[R]``: each row at its own step, as in continuous batching);
    ``salts``: ``token_salts(vocab)``, made here when not given."""
    if salts is None:
        salts = token_salts(vocab, keys.device)
    steps = torch.as_tensor(step, device=keys.device)
    if steps.dim() == 1:
        steps = steps.unsqueeze(1)
    z = _mix(keys.unsqueeze(1) + (steps + 1) * _STEP)
    z = _mix(z + salts.unsqueeze(0))
    # top 24 bits -> (0, 1), never exactly 0 or 1
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(
    keys: torch.Tensor, step: torch.Tensor | int, vocab: int, *, salts: torch.Tensor | None = None
) -> torch.Tensor:
    """Standard Gumbel noise ``[R, vocab]`` (float32)."""
    return -torch.log(-torch.log(uniform_noise(keys, step, vocab, salts=salts)))
