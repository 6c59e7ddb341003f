"""Language-model batches: next-token labels, loss mask, positions, micro-batch split.

The client sends ``input_ids`` ``[B, S]``; the model sees all ``S`` tokens, position ``t``
is trained to predict token ``t + 1``, and the last position (which has no next token)
is masked out of the loss, so each sample contributes ``S - 1`` loss tokens and the model
input length equals ``training.sequenceLength``.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LMBatch", "lm_batch", "split_microbatches"]


@dataclasses.dataclass(frozen=True)
class LMBatch:
    tokens: torch.Tensor  # int64 [b, s]
    labels: torch.Tensor  # int64 [b, s]
    loss_mask: torch.Tensor  # float32 [b, s]
    position_ids: torch.Tensor  # int64 [b, s]

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[1])


def lm_batch(input_ids: torch.Tensor, *, device: torch.device, vocab_size: int) -> LMBatch:
    """Validate ``input_ids`` and build the shifted next-token batch on ``device``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be int64, got {input_ids.dtype}")
    b, s = input_ids.shape
    if s < 2:
        raise ValueError("input_ids needs at least 2 tokens per sequence for a next-token loss")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{lo}, {hi}]")
    tokens = input_ids.to(device=device, dtype=torch.int64, non_blocking=True)
    labels = torch.empty_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, -1] = 0
    loss_mask = torch.ones((b, s), dtype=torch.float32, device=device)
    loss_mask[:, -1] = 0.0
    position_ids = torch.arange(s, device=device, dtype=torch.int64).unsqueeze(0).expand(b, s)
    return LMBatch(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)


def split_microbatches(batch: LMBatch, micro_batch_size: int) -> list[LMBatch]:
    if batch.batch_size % micro_batch_size != 0:
        raise ValueError(
            f"local batch {batch.batch_size} is not divisible by micro-batch size "
            f"{micro_batch_size}"
        )
    return [
        LMBatch(
            tokens=batch.tokens[i : i + micro_batch_size],
            labels=batch.labels[i : i + micro_batch_size],
            loss_mask=batch.loss_mask[i : i + micro_batch_size],
            position_ids=batch.position_ids[i : i + micro_batch_size],
        )
        for i in range(0, batch.batch_size, micro_batch_size)
    ]
