"""The training primitives of :class:`TrainEngine`: log-probs, forward/backward, step.

``compute_log_prob`` runs the model forward only. ``forward_backward`` adds the gradient
of a loss to the accumulated gradient; ``optim_step`` applies it (then discards it) and
``zero_grad`` discards it. ``TrainEngine.train_step`` is ``zero_grad`` ->
``forward_backward("cross_entropy")`` -> ``optim_step``.

Normalisation: the accumulated gradient is always the gradient of the **token mean** of
the loss over every loss token (``loss_mask``-weighted) fed since the last step: over
micro-batches, data-parallel ranks and calls. A call with ``N`` new loss tokens, after
``M`` accumulated ones, rescales the gradient so far by ``M / (M + N)`` and backpropagates
``sum(loss_mask * loss) / (M + N)``. So two calls then a step equal one call on the
concatenated batch (up to float rounding), and one call equals megatron's mean loss.

``reduction="sum"`` (Tinker's semantics): no rescaling at all; the accumulated gradient is the
gradient of the plain sum of ``loss_mask * loss`` over every token since the last step. The
two reductions cannot be mixed between two steps.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.loss_catalog import LossFn, resolve_loss
from tgruntime.trainer.optim import TrainingState, step_overrides
from tgruntime.trainer.schedule import ForwardBackwardFunc
from tgruntime.trainer.settings import RuntimeSettings
from tgruntime.trainer.token_batch import TokenBatch
from tgruntime.trainer.token_budget import auto_budget, plan_by_length, plan_micro_batches
from tgruntime.trainer.token_steps import dry_run_loss, logprob_forward_step, loss_forward_step

__all__ = [
    "REDUCTIONS",
    "ForwardBackwardResult",
    "LogProbResult",
    "OptimStepResult",
    "Primitives",
]

REDUCTIONS = ("mean", "sum")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogProbResult:
    """Per-token values of the local batch, ``[b, S-1]`` float32 on the CPU (0 on padding).

    Only the last pipeline stage has them: elsewhere both are None.
    """

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardBackwardResult:
    """One ``forward_backward`` call, identical on every rank of a data shard.

    With ``reduction="sum"`` the losses are sums (per sample, shard, global batch), not means.
    """

    per_sample_loss: tuple[float, ...]  # loss_mask-weighted mean (or sum) per local sample
    local_loss: float  # token mean (or sum) over this shard's part of the call
    loss: float  # token mean (or sum) over the call's global batch
    local_tokens: float  # sum of loss_mask on this shard
    tokens: float  # sum of loss_mask over the call's global batch
    accumulated_tokens: float  # global, since the last optimizer step (this call included)
    metrics: dict[str, float]  # the loss's metrics, token means over the global batch
    elapsed_s: float
    reduction: str = "mean"
    micro_batches: int = 1  # the token budget's split of the call
    # the CUDA caching allocator during the call (0 on CPU): new device allocations
    # (cudaMalloc) and allocations that had to free the cache and retry (near a full GPU)
    cuda_mallocs: int = 0
    alloc_retries: int = 0
    # per-token log-probs [b, T] of the local batch before this call's update (float32, CPU,
    # 0 on padding); only on the last pipeline stage, None elsewhere
    log_probs: torch.Tensor | None = None

    def meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("per_sample_loss", "metrics", "log_probs")
        }
        out.update({f"metrics/{k}": v for k, v in self.metrics.items()})
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimStepResult:
    step: int  # optimizer steps taken so far (this one included unless skipped)
    grad_norm: float  # global L2 norm before clipping
    lr: float  # the rate used (group 0, with its lr_mult)
    skipped: bool  # non-finite gradient (or fp16 overflow): no update
    tokens: float  # the loss tokens whose gradient was applied


SOFT_LOSSES = frozenset({"cross_entropy", "tinker_cross_entropy"})
"""The losses that take soft targets (``[B, S, K]`` target_ids)."""


def _default_micro_batch_size(local_batch: int, pp: int) -> int:
    """Whole batch without pipelining; with it, enough micro-batches (2 x stages) to fill it."""
    if pp == 1:
        return local_batch
    target = min(local_batch, 2 * pp)
    size = max(1, local_batch // target)
    while local_batch % size:
        size -= 1
    return size


def _as_sent(parts: list[torch.Tensor], order: list[int] | None, width: int) -> torch.Tensor:
    """Per-row results of the micro-batches back in the call's row order; per-token ones
    (``width`` > 0) padded with zeros to ``width`` columns."""
    if width:  # pad dimension 1 (a soft target's [b, T, K] keeps its K)
        parts = [
            torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]))
            if p.shape[1] < width else p
            for p in parts
        ]
    rows = torch.cat(parts)
    if order is None or all(i == r for r, i in enumerate(order)):
        return rows
    out = torch.empty_like(rows)
    out[torch.tensor(order, device=rows.device)] = rows
    return out


class Primitives:
    """Mixed into ``TrainEngine`` (which sets these attributes)."""

    settings: RuntimeSettings
    device: torch.device
    state: TrainingState
    step: int
    _mesh: Mesh
    _forward_backward: ForwardBackwardFunc
    _micro_batch_size: int | None
    _token_budget: int = 0  # tokens per micro-batch (0: no limit); token_budget.py
    _token_budget_source: str = "no limit"
    _per_token: int | None = None  # activation bytes per token: the budget follows free memory
    _accumulated: float = 0.0  # global loss tokens in the gradient since the last step
    _reduction: str | None = None  # the reduction of the pending gradient (None: no gradient)
    _grads_stale: bool = True  # the gradient buffers hold a discarded gradient

    def _check_open(self) -> None:  # overridden by TrainEngine
        pass

    def _sync(self) -> None:
        if self.settings.on_gpu:
            torch.cuda.synchronize(self.device)

    def _call_budget(self) -> dict[str, Any]:
        """This call's token budget and its source. Chosen from free memory (spec
        ``microBatchTokens`` 0 on a GPU), it is chosen again for every call from what is free
        now: the free device memory plus PyTorch's cached blocks. The sampler's KV pool and its
        weight copies, allocated after the start, are not free any more (a budget fixed at start
        counted them twice and ran the H100 out of memory in an RL loop). Every rank takes the
        smallest rank's budget, so all split the call alike (TP and PP collectives run per
        micro-batch)."""
        per_token = self._per_token
        if per_token is None or not self.settings.on_gpu:
            return {"budget": self._token_budget, "source": self._token_budget_source}
        free, _total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        available = free + max(0, cached)
        mine = auto_budget(free_bytes=available, per_token=per_token)
        t = torch.tensor([mine], dtype=torch.int64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        budget = int(t.item())
        return {"budget": budget, "source": (
            f"chosen for this call from {available / 2**30:.1f} GiB of free GPU memory "
            f"(this rank; the group takes its smallest), ~{per_token / 2**10:.0f} KiB of "
            "activations per token; spec.training.microBatchTokens sets it"
        )}

    def _micro(self, batch: TokenBatch) -> tuple[list[TokenBatch], int, list[int] | None]:
        """The call's micro-batches: the configured split, then at most the token budget;
        without pipelining longest rows first, each cut to its own longest row. The third
        item is the order of the rows across the micro-batches (None: as sent)."""
        mbs = self._micro_batch_size or _default_micro_batch_size(
            batch.batch_size, self._mesh.pp_size
        )
        if self._mesh.pp_size == 1:
            by_length = plan_by_length(
                lengths=batch.row_lengths(),
                seq_length=batch.seq_length,
                micro_batch_size=mbs,
                **self._call_budget(),
            )
            order = list(by_length.order)
            micro = [batch.take(order[a:b], width) for a, b, width in by_length.groups]
            return micro, by_length.micro_batch_size, order
        plan = plan_micro_batches(
            rows=batch.batch_size,
            seq_length=batch.seq_length,
            pp=self._mesh.pp_size,
            micro_batch_size=mbs,
            **self._call_budget(),
        )
        return [batch.rows(a, b) for a, b in plan.bounds], plan.micro_batch_size, None

    def _dp_sum(self, values: list[float]) -> list[float]:
        if self._mesh.dp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return [float(x) for x in t.cpu().tolist()]

    def _from_last_stage(self, payload: Any) -> Any:
        """Broadcast a small Python object from the last pipeline stage to the others."""
        if self._mesh.pp_size == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
            device=self.device if self.settings.on_gpu else None,
        )
        return box[0]

    # -- log-probs -------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_prob(self, batch: TokenBatch, *, entropy: bool = False) -> LogProbResult:
        """Per-token log-probs (and entropy) of ``batch``; forward only, gradient untouched."""
        self._check_open()
        micro, mbs, order = self._micro(batch)
        store = self._forward_backward(
            forward_step_func=logprob_forward_step(entropy),
            data_iterator=iter(micro),
            model=[self.state.model],
            num_microbatches=len(micro),
            seq_length=batch.seq_length,
            micro_batch_size=mbs,
            forward_only=True,
        )
        if not parallel_state.is_pipeline_last_stage():
            return LogProbResult(log_probs=None, entropy=None)
        t = batch.num_targets
        log_probs = _as_sent([r["log_probs"] for r in store], order, t).float().cpu()
        ent = _as_sent([r["entropy"] for r in store], order, t).float().cpu() if entropy else None
        return LogProbResult(log_probs=log_probs, entropy=ent)

    # -- gradients -------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Discard the accumulated gradient (local: no communication)."""
        self._check_open()
        self.state.zero_grad()
        self._accumulated = 0.0
        self._reduction = None
        self._grads_stale = False

    def forward_backward(
        self,
        batch: TokenBatch,
        *,
        loss: str | LossFn = "cross_entropy",
        loss_config: Mapping[str, Any] | None = None,
        reduction: str = "mean",
    ) -> ForwardBackwardResult:
        """Add the gradient of ``loss`` on ``batch`` to the accumulated one (no step).

        ``reduction``: ``"mean"`` (token mean over everything since the last step) or
        ``"sum"`` (plain sum, Tinker's); not mixed between two steps.
        """
        self._check_open()
        start = time.perf_counter()
        alloc0 = _allocator_counts(self.device, self.settings.on_gpu)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        pending = None if self._grads_stale else self._reduction
        if pending is not None and pending != reduction:
            raise ValueError(
                f"forward_backward(reduction={reduction!r}): the gradient accumulated since the "
                f"last optim_step used reduction={pending!r}; the two cannot be mixed: call "
                "optim_step or zero_grad first"
            )
        spec = resolve_loss(loss)
        config = dict(loss_config or {})
        if batch.soft and spec.name not in SOFT_LOSSES:
            raise ValueError(
                f"[B, S, K] target_ids (soft targets) are for cross-entropy, not {spec.name!r}: "
                "send [B, S] target_ids"
            )
        micro, mbs, order = self._micro(batch)
        if not batch.soft:  # soft targets run no registered loss (token_steps._soft_loss)
            dry_run_loss(spec, config, micro[0])
        local_tokens = float(batch.weights.sum())
        (tokens,) = self._dp_sum([local_tokens])
        if tokens <= 0 and reduction == "mean":
            raise ValueError(
                "forward_backward got no loss tokens: loss_mask x attention_mask[:, 1:] is all "
                "zero over the global batch"
            )
        if self._grads_stale:
            self.zero_grad()
        before = self._accumulated
        total = before + tokens
        if reduction == "mean" and before > 0:
            self.state.scale_grads(before / total)
        # DP averages the gradient: x dp gives the global sum
        scale = self._mesh.dp_size / (total if reduction == "mean" else 1.0)
        store = self._forward_backward(
            forward_step_func=loss_forward_step(
                spec=spec,
                config=config,
                scale=scale,
                num_microbatches=len(micro),
            ),
            data_iterator=iter(micro),
            model=[self.state.model],
            num_microbatches=len(micro),
            seq_length=batch.seq_length,
            micro_batch_size=mbs,
            forward_only=False,
        )
        self._accumulated = total
        self._reduction = reduction
        last = parallel_state.is_pipeline_last_stage()
        summary = self._summarise(store, reduction, order) if last else None
        per_sample, local_sum, loss_sum, metrics = self._from_last_stage(summary)
        log_probs = (
            _as_sent([r["log_probs"] for r in store], order, batch.num_targets).float().cpu()
            if last else None
        )
        self._sync()
        if reduction == "sum":
            local_loss, global_loss = local_sum, loss_sum
        else:
            local_loss = local_sum / local_tokens if local_tokens > 0 else 0.0
            global_loss = loss_sum / tokens
        return ForwardBackwardResult(
            per_sample_loss=tuple(per_sample),
            local_loss=local_loss,
            loss=global_loss,
            local_tokens=local_tokens,
            tokens=tokens,
            accumulated_tokens=total,
            metrics=metrics,
            elapsed_s=time.perf_counter() - start,
            reduction=reduction,
            micro_batches=len(micro),
            **_allocator_delta(alloc0, _allocator_counts(self.device, self.settings.on_gpu)),
            log_probs=log_probs,
        )

    def _summarise(
        self, store: list[dict[str, torch.Tensor]], reduction: str, order: list[int] | None
    ) -> tuple[list[float], float, float, dict[str, float]]:
        sums = _as_sent([r["sample_loss_sum"] for r in store], order, 0).float()
        weights = _as_sent([r["sample_weight"] for r in store], order, 0).float()
        names = sorted(k for k in store[0] if k.startswith("metric/"))
        parts = [sums.sum().reshape(1)]
        parts += [torch.stack([r[k] for r in store]).sum(dim=0) for k in names]
        packed = torch.cat(parts)
        local = packed.double().cpu().tolist()
        local_sum = local[0]
        reduced = self._dp_sum(local)
        if reduction == "sum":
            per_sample = sums.cpu()
        else:
            per_sample = (sums / weights.clamp(min=1e-12)).cpu()
            per_sample = torch.where(weights.cpu() > 0, per_sample, torch.zeros_like(per_sample))
        metrics = {}
        for i, key in enumerate(names):
            total, weight = reduced[1 + 2 * i], reduced[2 + 2 * i]
            metrics[key.removeprefix("metric/")] = total / weight if weight > 0 else 0.0
        return per_sample.tolist(), local_sum, reduced[0], metrics

    # -- optimizer -------------------------------------------------------------------
    def optim_step(
        self,
        *,
        lr: float | None = None,
        grad_clip: float | None = None,
        weight_decay: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
    ) -> OptimStepResult:
        """Apply the accumulated gradient (AdamW), then discard it.

        ``lr``, ``grad_clip`` (0: off), ``weight_decay``, ``betas``, ``eps``: for this step
        only (None: the spec's value); the spec's values are restored afterwards.
        """
        self._check_open()
        if self._reduction is None or self._grads_stale:
            raise RuntimeError(
                "optim_step: no gradient accumulated since the last step or zero_grad; "
                "call forward_backward first"
            )
        optimizer = self.state.optimizer
        with step_overrides(
            optimizer,
            lr=lr,
            clip_grad=grad_clip,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
        ):
            used_lr = float(optimizer.param_groups[0]["lr"])
            ok, grad_norm, _ = optimizer.step()
            if grad_norm is None:  # megatron skips the norm when clipping is off
                grad_norm = optimizer.get_grad_norm()
        if ok:
            self.step += 1
        tokens = self._accumulated
        self._accumulated = 0.0
        self._reduction = None
        self._grads_stale = True  # zeroed lazily by the next forward_backward / zero_grad
        return OptimStepResult(
            step=self.step,
            grad_norm=float(grad_norm),
            lr=used_lr,
            skipped=not ok,
            tokens=tokens,
        )


def _allocator_counts(device: torch.device, on_gpu: bool) -> tuple[int, int]:
    """(cudaMalloc calls, allocation retries) of the caching allocator so far; zeros on CPU."""
    if not on_gpu:
        return (0, 0)
    stats = torch.cuda.memory_stats(device)
    return (int(stats.get("num_device_alloc", 0)), int(stats.get("num_alloc_retries", 0)))


def _allocator_delta(before: tuple[int, int], after: tuple[int, int]) -> dict[str, int]:
    return {"cuda_mallocs": after[0] - before[0], "alloc_retries": after[1] - before[1]}
