"""The draw of a decode step: Gumbel-max over the tempered logits and the chosen token's model
log-prob, one compiled kernel on CUDA (docs/sampling.md, "The draw").

Eagerly, a draw over ``[R, V]`` logits is some thirty full passes: the noise hash alone is
a chain of int64 operations, each reading and writing ``R x V x 8`` bytes; with a 128 k
vocabulary at 64 rows that is about 4 GB of memory traffic a step, more than the 4-layer
Llama-3-8B block's weights. Compiled (``torch.compile``, dynamic batch), the hash, the
division, the argmax and the log-softmax fuse into row reductions that read the logits once
or twice. Both samplers (``select.next_token``, ``rows.next_token_rows``) draw here, so they
keep choosing the same tokens; the top-k / top-p filters stay eager (their sorts do not fuse).
``TG_SAMPLER_COMPILE=0`` turns the compiled draw off with the rest of the sampler's compile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from tgruntime.trainer.sampling.lean_layer import compile_wanted
from tgruntime.trainer.sampling.noise import gumbel_noise, token_salts

__all__ = ["draw"]

log = logging.getLogger("tgruntime.trainer.sampling.draw")


def _draw(
    logits: torch.Tensor,
    z: torch.Tensor | None,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    step: torch.Tensor | int,
    salts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if z is None:  # no filter: only the division by the temperature (0: greedy, divide by 1)
        safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        z = logits / safe.to(logits.dtype).unsqueeze(-1)
    sampled = (z + gumbel_noise(keys, step, z.shape[-1], salts=salts)).argmax(dim=-1)
    token = torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
    logprob = torch.log_softmax(logits, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
    return token, logprob


_COMPILED: list[Callable[..., Any]] = []


def draw(
    logits: torch.Tensor,
    z: torch.Tensor | None,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    step: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ``[R]`` int64, its model log-prob ``[R]`` fp32) from fp32 ``logits [R, V]``.

    ``z``: the filtered, tempered logits (None: ``logits / temperature``); ``temperature``
    ``[R]`` or ``[1]`` (a row at 0 takes the argmax of ``logits``); ``keys`` ``[R]`` and
    ``step`` (``[R]``, ``[1]`` or an int) seed the row's noise (``noise.py``)."""
    salts = _salts(logits.shape[-1], logits.device)
    if _use_compiled(logits.device):
        if not _COMPILED:  # one per process: every sampler shares Dynamo's cache for it
            _COMPILED.append(torch.compile(_draw, fullgraph=True, dynamic=True))
        try:
            out: tuple[torch.Tensor, torch.Tensor] = _COMPILED[0](
                *_one_signature(logits, z, temperature, keys, step), salts
            )
            return out
        except _compile_errors() as exc:
            # the same tokens eagerly (tested bit for bit), only slower
            _BROKEN.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            log.warning(
                "sampler: the compiled draw failed to compile (%s); drawing eagerly from now "
                "on in this process (TG_SAMPLER_COMPILE=0 skips the compiler)",
                _BROKEN[-1],
            )
    return _draw(logits, z, temperature, keys, step, salts)


def _one_signature(
    logits: torch.Tensor,
    z: torch.Tensor | None,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    step: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draw's arguments in the one form every caller shares: ``temperature``, ``keys``
    and ``step`` as ``[R]`` tensors, ``logits`` and ``z`` as tensors that are not views.

    Dynamo guards on what it saw: a ``[1]`` temperature beside ``[R]`` logits (one-shot
    sampling) and ``[R]`` (the engine's rows) are two graphs, and so are logits that are a
    view of the decoder's ``[1, R, V]`` output and logits made by ``repeat_interleave`` (a
    prompt's samples). The warm-up covers one of each form it meets; an RL call's
    ``num_samples > 1`` then met a form it had not: on an H100 (2026-12-08) the first such
    call took 2.3 s against 0.5 s steady, and ``TORCH_LOGS=recompiles`` named the draw. In
    one form, every batch of 2 rows or more shares one graph (1
    row: Dynamo's own). Same values: a ``[1]`` tensor broadcasts to what ``expand`` copies,
    and ``detach`` aliases the same memory without the view's record (no copy)."""
    rows = logits.shape[0]

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t if t.shape[0] == rows else t.expand(rows).contiguous()

    steps = (
        torch.full((rows,), step, dtype=torch.int64, device=logits.device)
        if isinstance(step, int)
        else per_row(step)
    )
    return (
        logits.detach(),
        None if z is None else z.detach(),
        per_row(temperature),
        per_row(keys),
        steps,
    )


def _compile_errors() -> tuple[type[Exception], ...]:
    """What a failed compile raises. Imported here, where ``torch.compile`` already loaded
    Dynamo and Inductor, not at this module's import: a worker that never compiles (the CPU
    path) keeps starting without the compiler (docs/trainer.md, "CPU path and GPU path")."""
    import torch._dynamo.exc
    import torch._inductor.exc

    inductor = getattr(torch._inductor.exc, "InductorError", None)  # torch >= 2.7
    return (
        torch._dynamo.exc.BackendCompilerFailed,
        *((inductor,) if inductor is not None else ()),
    )


_BROKEN: list[str] = []  # why the compiled draw was given up (empty: it was not)


def _use_compiled(device: torch.device) -> bool:
    """On CUDA (where it was measured) with the sampler's compile on (``TG_SAMPLER_COMPILE``),
    unless a compile of it failed in this process."""
    return device.type == "cuda" and not _BROKEN and compile_wanted(device=device, tp=False)


_SALTS: dict[tuple[int, str], torch.Tensor] = {}


def _salts(vocab: int, device: torch.device) -> torch.Tensor:
    """``noise.token_salts``, made once per vocabulary and device (a persistent address, so a
    CUDA graph that captured a draw keeps reading it)."""
    key = (vocab, str(device))
    salts = _SALTS.get(key)
    if salts is None:
        salts = _SALTS[key] = token_salts(vocab, device)
    return salts
