"""Per-token batches for ``compute_log_prob`` and ``forward_backward``.

Alignment (one rule everywhere): for ``input_ids`` ``[B, S]`` the trainer's per-token
values have ``T = S - 1`` columns and column ``j`` belongs to token ``j + 1``:
``log_probs[:, j] = log p(input_ids[:, j + 1] | input_ids[:, :j + 1])``. Per-token inputs
(``loss_mask``, ``advantages``, ``old_log_probs``, ``ref_log_probs``, a user loss's own
tensors) are accepted either ``[B, S - 1]`` (aligned with ``log_probs``) or ``[B, S]``
(aligned with ``input_ids``; column 0, the first token, which has no log-prob, is dropped).

``attention_mask`` ``[B, S]`` (1 = real token) must be right-padded (each row: ones, then
zeros). Padded targets get log-prob 0 and weight 0; real tokens never attend to padding
(causal attention), so their log-probs are those of the unpadded sequence.

Explicit targets (Tinker's ``target_tokens``): with ``target_ids`` int64 ``[B, S]`` there is no
shift: ``T = S`` columns, ``log_probs[:, j] = log p(target_ids[:, j] | input_ids[:, :j + 1])``,
every per-token input is ``[B, S]``, and ``attention_mask[:, j]`` marks column ``j`` real.

Soft targets (Tinker's ``[N, K]`` ``target_tokens``, top-K distillation): ``target_ids``
int64 ``[B, S, K]`` and ``target_weights`` float ``[B, S, K]`` (default ones). Column ``j``
scores the K ids ``target_ids[:, j]``; ``cross_entropy`` is then
``-sum(target_weights * log_probs)`` and the log-probs are ``[B, S, K]``, all from one forward
pass (``target_logprobs.py``). ``weights`` (the token count of a mean) is the row's summed
target weight, as if each of the K columns were a row of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

__all__ = [
    "PER_TOKEN",
    "RESERVED",
    "SOFT_WEIGHTS",
    "TokenBatch",
    "check_target_ids",
    "split_token_batch",
    "token_batch",
]

RESERVED = frozenset(
    {"input_ids", "attention_mask", "loss_mask", "position_ids", "target_ids", "target_weights"}
)
SOFT_WEIGHTS = "target_weights"  # [b, T, K] in ``extras`` with [b, S, K] labels (x valid)
PER_TOKEN = frozenset({"advantages", "old_log_probs", "ref_log_probs"})  # always [B, S(-1)]


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    tokens: torch.Tensor  # int64 [b, S]: the model input
    position_ids: torch.Tensor  # int64 [b, S]
    labels: torch.Tensor  # int64 [b, S]: tokens[:, t + 1] (last column 0), or target_ids
    # ([b, S] or, for soft targets, [b, S, K])
    valid: torch.Tensor  # float32 [b, T]: 1 where the target token is real (attention_mask)
    weights: torch.Tensor  # float32 [b, T]: loss weights (loss_mask x valid)
    extras: dict[str, torch.Tensor]  # per-token [b, T] (or per-sample [b, ...]) loss inputs

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_length(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def num_targets(self) -> int:
        """Per-token columns T: ``S - 1`` (shifted inputs) or ``S`` (explicit target_ids)."""
        return int(self.valid.shape[1])

    @property
    def soft(self) -> bool:
        """K targets per position (``labels`` [b, S, K]): cross-entropy on soft targets."""
        return self.labels.dim() == 3

    @property
    def shift(self) -> int:
        """1 when column ``j`` scores token ``j + 1`` (shifted inputs), 0 with target_ids."""
        return self.seq_length - self.num_targets

    def row_lengths(self) -> list[int]:
        """The tokens each row needs: up to its last real target (rows are right-padded), at
        least one target."""
        cols = torch.arange(1, self.num_targets + 1, device=self.valid.device)
        last = ((self.valid > 0) * cols).amax(dim=1) if self.num_targets else cols[:0]
        return [max(int(x) + self.shift, self.shift + 1) for x in last.tolist()]

    def take(self, index: list[int], width: int) -> TokenBatch:
        """Rows ``index`` (in that order), cut to their first ``width`` tokens; per-token
        tensors (``[b, T]``, or ``[b, T, ...]``) to the matching ``width - shift`` columns."""
        t, cols = self.num_targets, width - self.shift
        idx = torch.tensor(index, dtype=torch.int64, device=self.tokens.device)  # one copy

        def rows(v: torch.Tensor) -> torch.Tensor:
            return v.index_select(0, idx if v.device == idx.device else idx.to(v.device))

        def cut(v: torch.Tensor) -> torch.Tensor:
            v = rows(v)
            return v[:, :cols] if v.dim() >= 2 and v.shape[1] == t else v

        return TokenBatch(
            tokens=rows(self.tokens)[:, :width],
            position_ids=rows(self.position_ids)[:, :width],
            labels=rows(self.labels)[:, :width],
            valid=cut(self.valid),
            weights=cut(self.weights),
            extras={k: cut(v) for k, v in self.extras.items()},
        )

    def rows(self, start: int, stop: int) -> TokenBatch:
        return TokenBatch(
            tokens=self.tokens[start:stop],
            position_ids=self.position_ids[start:stop],
            labels=self.labels[start:stop],
            valid=self.valid[start:stop],
            weights=self.weights[start:stop],
            extras={k: v[start:stop] for k, v in self.extras.items()},
        )


def _per_token(
    name: str, value: torch.Tensor, b: int, s: int, *, explicit: bool = False
) -> torch.Tensor:
    """A per-token tensor in log-prob alignment [b, S-1] (from [b, S-1] or [b, S]); with
    explicit targets, [b, S] as sent."""
    if explicit:
        if value.dim() == 2 and tuple(value.shape) == (b, s):
            return value
        raise ValueError(
            f"batch[{name!r}] has shape {tuple(value.shape)}; with target_ids a per-token "
            f"tensor must be [B, S] = [{b}, {s}] (aligned with target_ids)"
        )
    if value.dim() == 2 and value.shape[0] == b and value.shape[1] == s - 1:
        return value
    if value.dim() == 2 and value.shape[0] == b and value.shape[1] == s:
        return value[:, 1:]
    raise ValueError(
        f"batch[{name!r}] has shape {tuple(value.shape)}; a per-token tensor must be "
        f"[B, S-1] = [{b}, {s - 1}] (aligned with log_probs) or [B, S] = [{b}, {s}] "
        "(aligned with input_ids)"
    )


def token_batch(
    tensors: Mapping[str, torch.Tensor], *, device: torch.device, vocab_size: int
) -> TokenBatch:
    """Validate a DataProto's tensors and build the batch on ``device``."""
    if "input_ids" not in tensors:
        raise ValueError(
            f"the DataProto needs batch['input_ids'] (int64 [B, S]); it holds {sorted(tensors)}"
        )
    input_ids = tensors["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be int64, got {input_ids.dtype}")
    b, s = (int(x) for x in input_ids.shape)
    if s < 2:
        raise ValueError("input_ids needs at least 2 tokens per sequence (log-probs start at 1)")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{lo}, {hi}]")
    explicit = "target_ids" in tensors
    tokens = input_ids.to(device=device, dtype=torch.int64)
    if explicit:
        labels = check_target_ids(tensors["target_ids"], b=b, s=s, vocab_size=vocab_size)
        labels = labels.to(device=device, dtype=torch.int64)
    else:
        labels = torch.zeros_like(tokens)
        labels[:, :-1] = tokens[:, 1:]

    valid = torch.ones((b, s if explicit else s - 1), dtype=torch.float32)
    if "attention_mask" in tensors:
        mask = tensors["attention_mask"]
        if tuple(mask.shape) != (b, s):
            raise ValueError(f"attention_mask must be [B, S] = [{b}, {s}], got {tuple(mask.shape)}")
        m = mask.to(torch.float32)
        if bool(((m != 0) & (m != 1)).any()):
            raise ValueError("attention_mask must hold only 0 and 1")
        if bool((m[:, 1:] > m[:, :-1]).any()):
            raise ValueError(
                "attention_mask must be right-padded (each row: ones, then zeros); "
                "left padding is not supported: move the padding to the end"
            )
        valid = (m if explicit else m[:, 1:]).contiguous()
    weights = valid.clone()
    if "loss_mask" in tensors:
        mask_t = _per_token("loss_mask", tensors["loss_mask"], b, s, explicit=explicit)
        weights = weights * mask_t.float()
    extras: dict[str, torch.Tensor] = {}
    if labels.dim() == 3:  # soft targets: the K columns' weights, zero where nothing is real
        tw = _soft_weights(tensors.get(SOFT_WEIGHTS), tuple(labels.shape))
        tw = tw * weights.unsqueeze(-1)
        extras[SOFT_WEIGHTS] = tw.to(device)
        weights = tw.sum(dim=-1)
    elif SOFT_WEIGHTS in tensors:
        raise ValueError(
            f"batch[{SOFT_WEIGHTS!r}] goes with [B, S, K] target_ids (soft targets); these "
            "target_ids are [B, S]: send the weights as loss_mask"
        )
    for name, value in tensors.items():
        if name in RESERVED:
            continue
        if name in PER_TOKEN or (value.dim() == 2 and value.shape[1] in (s, s - 1)):
            value = _per_token(name, value, b, s, explicit=explicit)
        extras[name] = value.to(device)
    return TokenBatch(
        tokens=tokens,
        position_ids=torch.arange(s, device=device, dtype=torch.int64).unsqueeze(0).expand(b, s),
        labels=labels,
        valid=valid.to(device),
        weights=weights.to(device),
        extras=extras,
    )


def _soft_weights(value: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if value is None:
        return torch.ones(shape, dtype=torch.float32)
    if tuple(value.shape) != shape:
        raise ValueError(
            f"batch[{SOFT_WEIGHTS!r}] has shape {tuple(value.shape)}; with target_ids "
            f"{list(shape)} it must be {list(shape)} too (one weight per target id)"
        )
    if not torch.is_floating_point(value) or not bool(torch.isfinite(value).all()):
        raise ValueError(f"batch[{SOFT_WEIGHTS!r}] must be finite floats")
    return value.to(torch.float32)


def check_target_ids(target_ids: torch.Tensor, *, b: int, s: int, vocab_size: int) -> torch.Tensor:
    """``target_ids`` is int ``[B, S]`` (the shape of input_ids), or ``[B, S, K]`` (soft
    targets, K >= 1), with ids in ``[0, vocab)``."""
    if target_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target_ids must be int64, got {target_ids.dtype}")
    shape = tuple(target_ids.shape)
    if shape[:2] != (b, s) or len(shape) not in (2, 3) or (len(shape) == 3 and shape[2] < 1):
        raise ValueError(
            f"target_ids must be [B, S] = [{b}, {s}] (the shape of input_ids), or [{b}, {s}, K] "
            f"(K >= 1 soft targets per position), got {shape}"
        )
    if target_ids.numel():
        lo, hi = int(target_ids.min()), int(target_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"target_ids must lie in [0, {vocab_size}) (the model's vocab_size is "
                f"{vocab_size}), got ids in [{lo}, {hi}]"
            )
    return target_ids


def split_token_batch(batch: TokenBatch, micro_batch_size: int) -> list[TokenBatch]:
    if batch.batch_size % micro_batch_size != 0:
        raise ValueError(
            f"local batch {batch.batch_size} is not divisible by micro-batch size "
            f"{micro_batch_size}"
        )
    return [
        batch.rows(i, i + micro_batch_size) for i in range(0, batch.batch_size, micro_batch_size)
    ]
