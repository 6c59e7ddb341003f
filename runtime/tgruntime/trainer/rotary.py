"""A CPU-safe rotary position embedding for megatron-core's ``GPTModel``.

megatron-core's ``RotaryEmbedding.get_emb`` (0.16 through 0.19.2) moves its inverse
frequencies to ``torch.cuda.current_device()`` on first use, which fails on a machine without
a GPU.
:func:`make_rotary_cpu_safe` swaps the class of a built model's rotary module for a subclass
that keeps the frequencies on whatever device they were created on; the arithmetic is
unchanged, so a CPU run with ``position_embedding: rope`` computes the same model as a GPU
run.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

__all__ = ["DeviceLocalRotaryEmbedding", "make_rotary_cpu_safe"]


class DeviceLocalRotaryEmbedding(RotaryEmbedding):  # type: ignore[misc]
    """``RotaryEmbedding`` whose frequencies stay on their own device."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        return emb[:, None, None, :]


def make_rotary_cpu_safe(model: torch.nn.Module) -> None:
    """Make every megatron ``RotaryEmbedding`` inside ``model`` device-local (in place)."""
    for module in model.modules():
        if type(module) is RotaryEmbedding:
            module.__class__ = DeviceLocalRotaryEmbedding
