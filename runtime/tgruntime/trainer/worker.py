"""``MegatronTrainer``: the built-in TrainerGroup worker (a Ray actor of the controller layer).

Each actor is one rank of the training job and drives one :class:`TrainEngine`. Group
calls fan out as the decorators say: set-up, checkpoints and queries go to every rank
(``ONE_TO_ALL``); ``train_model`` is mesh-aware: the client's batch is split by
data-parallel rank of the ``"train"`` mesh, every rank of a data shard (its tensor and
pipeline peers) gets the same part, and only the collected rank of each shard (tensor rank
0 of the last pipeline stage) returns its output.

Wire format of ``train_model``: in, a DataProto with ``batch["input_ids"]`` int64
``[B, S]``; out, a DataProto with ``batch["loss"]`` float32 ``[B_shard]`` (mean next-token
loss per sample) and ``meta_info`` metrics of the whole step: ``loss`` (mean over the global
batch), ``grad_norm``, ``tokens`` (global), ``step_time_s``, ``step``, ``lr``, ``skipped``,
``rank``, ``dp_rank``, ``shard_loss``.

LoRA: the spec's ``lora`` (``tgapi.model.LoraSpec``), or the optional second constructor
argument ``lora_json``, which wins when given (a JSON object of
``LoraSettings`` fields: ``rank``, ``alpha``, ``seed``, ``train_attn``, ``train_mlp``,
``train_unembed``; unknown fields refused) makes the group train LoRA adapters on the frozen
base (``TrainEngine.create(lora=...)``); absent, null or rank 0: full-weight training.
Checkpoints then hold the adapters, ``export_lora`` writes them in PEFT's format, sampling
uses the active run's adapters or a snapshot (``sampling.mixin``), and ``create_run`` and its
siblings hold many runs on the one frozen base (``lora.runs``; docs/lora.md).

Progress: after every optimizer step (``train_model``, or ``optim_step`` after
``forward_backward`` calls) rank 0 writes the step, loss, gradient norm, tokens/s and the
time into the group record's ``training`` (``tgapi.progress.TrainingProgress``), from a
background thread that writes the newest value (``progress_writer``): the step never waits on
the GCS, and a failed write is logged once at warning and never fails the step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tgapi import TrainerGroupSpec, parse_spec
from tgapi.hub import local_dir
from tgapi.progress import MAX_LISTED_RUNS, RunProgress, TrainingProgress
from tgruntime.controller import (
    Dispatch,
    Worker,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)
from tgruntime.trainer import warm_up
from tgruntime.trainer.engine import StepResult, TrainEngine
from tgruntime.trainer.hf_worker import HFWeightsMixin
from tgruntime.trainer.lora import LoraSettings
from tgruntime.trainer.lora.runs import DEFAULT_RUN, RunSet
from tgruntime.trainer.losses import LossFn
from tgruntime.trainer.progress_writer import ProgressWriter
from tgruntime.trainer.sampling.mixin import SamplingMixin
from tgruntime.trainer.token_batch import TokenBatch, token_batch

if TYPE_CHECKING:  # loaded where a DataProto arrives: tensordict imports TorchDynamo (~3-6 CPU s)
    from tgruntime.controller.dataproto import DataProto

__all__ = ["TRAIN_MESH", "MegatronTrainer"]

TRAIN_MESH = "train"


def _parse_lora(lora_json: str | None) -> LoraSettings | None:
    """The worker's LoRA argument: a JSON object of ``LoraSettings`` fields (or None/null)."""
    if lora_json is None:
        return None
    values = json.loads(lora_json)
    if values is None:
        return None
    if not isinstance(values, dict):
        raise ValueError(f"lora_json must be a JSON object of LoRA settings, not {values!r}")
    settings = LoraSettings.from_mapping(values)
    return settings if settings.enabled else None


@dataclasses.dataclass
class _Pending:
    """The forward_backward calls since the last optimizer step (for its progress)."""

    started: float  # time.perf_counter() when the first one began
    loss_sum: float = 0.0  # sum of loss x tokens ("mean") or of the summed losses ("sum")
    tokens: float = 0.0
    reduction: str = "mean"


class MegatronTrainer(SamplingMixin, HFWeightsMixin, Worker):
    """One rank of a Megatron GPT training job inside a TrainerGroup."""

    def __init__(self, spec_json: str, lora_json: str | None = None) -> None:
        super().__init__()
        self.spec: TrainerGroupSpec = parse_spec(json.loads(spec_json), local=True)
        self.lora: LoraSettings | None = _parse_lora(lora_json)
        if lora_json is None and self.spec.lora is not None:  # spec.lora: the group's own
            self.lora = LoraSettings.from_mapping(self.spec.lora.settings())
        self.engine: TrainEngine | None = None
        self.resumed_from: str | None = None
        self.pretrained_from: str | None = None  # model.pretrained, when init_model loaded it
        self.warm_up_s: float | None = None  # init_model's compile warm-up (GPU), seconds
        self._pending: _Pending | None = None
        self._progress: ProgressWriter | None = None  # rank 0's record writer, made on first use
        self._runs: RunSet | None = None  # many LoRA runs: made by the first create_run
        self._pendings: dict[str, _Pending | None] = {}  # the inactive runs' pending steps

    def _engine(self) -> TrainEngine:
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank}: call init_model() before training")
        self._training_weights()  # a sampler snapshot held between chunks goes out first
        return self.engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Join torch.distributed, build model and optimizer, resume from the newest checkpoint.

        Returns this rank's mesh (``TrainEngine.mesh()``) plus ``resumed_step`` (None when
        ``training.checkpointDir`` is empty or holds no complete checkpoint). With
        ``model.pretrained`` and nothing to resume, the base weights are loaded from that
        Hugging Face directory (``import_hf``); a checkpoint, when there is one, wins.

        Resume (``TrainEngine.resume``): rank 0 chooses the checkpoint and broadcasts its
        step; a rank that cannot read that step from its own ``checkpointDir`` fails every
        rank with ``CheckpointUnreadableError`` (path, step, node).
        """
        if self.engine is None:
            self.engine = TrainEngine.create(spec=self.spec, lora=self.lora)
            release = getattr(self, "release_master_port", None)
            if release is not None:  # the process group is up: the port is the store's now
                release()
            mesh = self.engine.mesh_info
            self._register_dispatch_collect_info(
                TRAIN_MESH, dp_rank=mesh.dp_rank, is_collect=mesh.is_collect
            )
            # one resume point: rank 0 chooses, every rank loads that step or the group fails
            self.resumed_from = self.engine.resume()
            pretrained = self.spec.model.pretrained
            if pretrained and self.resumed_from is None:
                self.import_hf(local_dir(pretrained, weights=True))  # a hub id: downloaded
                self.pretrained_from = pretrained
            if warm_up.wanted(self.engine):  # compile now, not in the first requests
                # the sampler's pool and graphs at start only for a group that serves the
                # Tinker API (whose sampling uses them): a training-only group keeps that
                # memory until something samples
                graphs = None
                if self.spec.api.tinker:
                    graphs = lambda: self._capture_graphs(self._engine())  # noqa: E731
                self.warm_up_s = warm_up.warm_up(
                    self.engine,
                    self._sampler_for(self.engine),
                    graphs=graphs,
                    generate=self._warm_generate,
                )
        return self.get_mesh()

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=TRAIN_MESH))
    def train_model(self, data: DataProto) -> DataProto:
        """One optimizer step on this data shard's part of the batch."""
        from tgruntime.controller.dataproto import DataProto

        engine = self._engine()
        if data.batch is None or "input_ids" not in data.batch:
            raise ValueError("train_model needs a DataProto with batch['input_ids'] (int64 [B, S])")
        result = engine.train_step(data.batch["input_ids"])
        self._pending = None
        # the mesh is added when read (last_step): engine.mesh() counts the parameters, ~1 ms
        self._last_step = {"rank": self.rank, "step": engine.step, "loss": result.loss}
        metrics = self._step_metrics(engine, result)
        self._record_progress(
            step=engine.step,
            loss=float(metrics["loss"]),
            grad_norm=result.grad_norm,
            tokens=float(metrics["tokens"]),
            seconds=result.step_time_s,
        )
        return DataProto.from_dict(
            tensors={"loss": torch.tensor(result.per_sample_loss, dtype=torch.float32)},
            meta_info=metrics,
        )

    def _record_progress(
        self, *, step: int, loss: float | None, grad_norm: float, tokens: float, seconds: float
    ) -> None:
        """Rank 0: the step into the group record's ``training``, in the background."""
        if self.rank != 0:
            return
        if self._progress is None:
            from tgruntime.controller import worker as base

            group = os.environ.get(base.ENV_GROUP)
            ray_namespace = os.environ.get(base.ENV_NAMESPACE)
            if not group or not ray_namespace:  # not created by a WorkerGroup: no record
                return
            self._progress = ProgressWriter(group_name=group, ray_namespace=ray_namespace)
        self._progress.submit(
            TrainingProgress(
                step=step,
                loss=loss,
                grad_norm=grad_norm,
                tokens_per_s=tokens / seconds if seconds > 0 else None,
                last_step_at=time.time(),
                **self._run_progress(),
            )
        )

    def _run_progress(self) -> dict[str, Any]:
        """A LoRA group's runs for the progress record (nothing for one run)."""
        if self._runs is None:
            return {}
        runs = sorted(self._runs.describe(), key=lambda r: -float(r["lastActive"]))
        listed = tuple(
            RunProgress(run_id=r["id"], steps=int(r["steps"]), last_active=float(r["lastActive"]))
            for r in runs[:MAX_LISTED_RUNS]
        )
        return {"runs": len(runs), "run_list": listed}

    def _step_metrics(self, engine: TrainEngine, result: StepResult) -> dict[str, Any]:
        mesh = engine.mesh_info
        metrics = result.metrics()
        metrics.update(rank=self.rank, dp_rank=mesh.dp_rank, shard_loss=result.loss)
        if mesh.dp_size > 1:
            # meta_info of the first collected shard stands for the step: make it global.
            totals = torch.tensor(
                [result.loss * result.tokens, float(result.tokens)],
                dtype=torch.float64,
                device=engine.device,
            )
            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
            loss_tokens, tokens = totals.tolist()
            metrics.update(loss=loss_tokens / tokens, tokens=int(tokens))
        return metrics

    # -- RL primitives (docs/trainer.md, "Training primitives") -----------------------
    def _token_batch(self, engine: TrainEngine, data: DataProto, method: str) -> TokenBatch:
        keys = [] if data.batch is None else [str(k) for k in data.batch.keys()]  # noqa: SIM118
        if data.batch is None or "input_ids" not in keys:
            raise ValueError(f"{method} needs a DataProto with batch['input_ids'] (int64 [B, S])")
        tensors = {k: data.batch[k] for k in keys}
        return token_batch(tensors, device=engine.device, vocab_size=self.spec.model.vocab_size)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=TRAIN_MESH))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Per-token log-probs ``[B, S-1]``, or ``[B, S]`` with ``batch["target_ids"]``
        (``meta_info={"entropy": True}``: and entropy)."""
        from tgruntime.controller.dataproto import DataProto

        engine = self._engine()
        entropy = bool(data.meta_info.get("entropy", False))
        result = engine.compute_log_prob(
            self._token_batch(engine, data, "compute_log_prob"), entropy=entropy
        )
        meta = {"rank": self.rank, "dp_rank": engine.mesh_info.dp_rank, "entropy": entropy}
        if result.log_probs is None:  # not the last pipeline stage: not collected
            return DataProto(meta_info=meta)
        tensors = {"log_probs": result.log_probs}
        if result.entropy is not None:
            tensors["entropy"] = result.entropy
        return DataProto.from_dict(tensors=tensors, meta_info=meta)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=TRAIN_MESH))
    def forward_backward(
        self,
        data: DataProto,
        loss: str | LossFn = "cross_entropy",
        loss_config: dict[str, Any] | None = None,
        reduction: str = "mean",
    ) -> DataProto:
        """Accumulate the gradient of ``loss`` on this shard's part of the batch (no step).

        Returns ``batch["loss"]`` per sample (mean, or sum with ``reduction="sum"``) and
        ``batch["log_probs"]`` per token (before this call's update)."""
        from tgruntime.controller.dataproto import DataProto

        engine = self._engine()
        started = time.perf_counter()
        result = engine.forward_backward(
            self._token_batch(engine, data, "forward_backward"),
            loss=loss,
            loss_config=loss_config,
            reduction=reduction,
        )
        pending = self._pending
        if pending is None or pending.reduction != result.reduction:
            pending = self._pending = _Pending(started=started, reduction=result.reduction)
        weight = result.tokens if result.reduction == "mean" else 1.0
        pending.loss_sum += result.loss * weight
        pending.tokens += result.tokens
        meta = result.meta()
        meta.update(rank=self.rank, dp_rank=engine.mesh_info.dp_rank, step=engine.step)
        tensors = {"loss": torch.tensor(result.per_sample_loss, dtype=torch.float32)}
        if result.log_probs is not None:
            tensors["log_probs"] = result.log_probs
        return DataProto.from_dict(tensors=tensors, meta_info=meta)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def optim_step(
        self,
        lr: float | None = None,
        grad_clip: float | None = None,
        weight_decay: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
    ) -> dict[str, Any]:
        """Apply the accumulated gradient; overrides hold for this step only."""
        engine = self._engine()
        result = engine.optim_step(
            lr=lr,
            grad_clip=grad_clip,
            weight_decay=weight_decay,
            betas=None if betas is None else (float(betas[0]), float(betas[1])),
            eps=eps,
        )
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending.reduction == "mean":
                step_loss = pending.loss_sum / pending.tokens if pending.tokens > 0 else None
            else:
                step_loss = pending.loss_sum
            self._record_progress(
                step=result.step,
                loss=step_loss,
                grad_norm=result.grad_norm,
                tokens=result.tokens,
                seconds=time.perf_counter() - pending.started,
            )
        return {**dataclasses.asdict(result), "rank": self.rank}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def zero_grad(self) -> bool:
        """Discard the accumulated gradient."""
        self._engine().zero_grad()
        self._pending = None
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_state(self, path: str) -> str:
        """Model, optimizer, step and RNG, one file per (tp, pp) shard under ``path``."""
        return self._engine().save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_state(self, path: str, optimizer: bool = True) -> int:
        """Restore what ``save_state`` wrote (same tp and pp); returns the restored step.

        ``optimizer=False``: weights only, fresh optimizer state (Tinker's load_weights)."""
        return self._engine().load_checkpoint(path, optimizer=optimizer)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def last_step(self) -> dict[str, Any] | None:
        """This rank's view of the last step (rank, mesh, step, loss): tensor-parallel peers
        must agree on the loss; a client or test compares them."""
        last: dict[str, Any] | None = getattr(self, "_last_step", None)
        if last is None or self.engine is None:
            return last
        mesh = self.engine.mesh()
        return {"rank": last["rank"], **mesh, "step": last["step"], "loss": last["loss"]}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str | None = None) -> str:
        """Write a checkpoint (default ``{checkpointDir}/step_{step:08d}``); returns its path."""
        return self._engine().save_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Restore model, optimizer, step and RNG from ``path``; returns the restored step."""
        return self._engine().load_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_lora(self, path: str, base_model: str = "") -> dict[str, Any]:
        """Write the LoRA adapters in PEFT's format (``adapter_config.json`` and
        ``adapter_model.safetensors``) into directory ``path`` (global rank 0 writes; the
        path must exist there only); returns path, tensors, bytes on every rank."""
        engine = self._engine()
        if engine.adapters is None:
            raise ValueError(
                "export_lora: this group trains full weights (no LoRA adapters); use export_hf"
            )
        from tgruntime.trainer.lora import export_peft

        return export_peft(engine.adapters, path, base_model=base_model)

    # -- many LoRA runs on one group (lora.runs; docs/lora.md) ----------------------------
    def _run_set(self) -> RunSet:
        if self._runs is None:
            self._runs = RunSet(self._engine())
        return self._runs

    def _switch_pending(self, run_id: str) -> None:
        runs = self._run_set()
        self._pendings[runs.active] = self._pending
        self._pending = self._pendings.pop(run_id, None)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def create_run(self, run_id: str, lora_json: str) -> dict[str, Any]:
        """A new LoRA run (its own adapters, AdamW state and step) on the group's frozen
        base, from a JSON object of ``LoraSettings`` fields; it becomes the active run."""
        settings = _parse_lora(lora_json)
        if settings is None:
            raise ValueError("create_run: lora_json needs a rank of at least 1")
        runs = self._run_set()
        self._switch_pending(run_id)
        try:
            return runs.create(run_id, settings)
        except BaseException:
            self._switch_pending(runs.active)
            raise

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_run(self, run_id: str) -> dict[str, Any]:
        """Make ``run_id`` the run the next calls train, sample or save (a parked run is
        brought back first)."""
        runs = self._run_set()
        if run_id != runs.active:
            self._switch_pending(run_id)
        return runs.use(run_id)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def drop_run(self, run_id: str) -> bool:
        runs = self._run_set()
        if run_id == runs.active:
            self.use_run(DEFAULT_RUN)
        runs.drop(run_id)
        self._pendings.pop(run_id, None)
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def park_run(self, run_id: str, path: str) -> dict[str, Any]:
        """Write a run's whole state to directory ``path`` and free its memory."""
        runs = self._run_set()
        if run_id == runs.active:
            self.use_run(DEFAULT_RUN)
        return runs.park(run_id, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def list_runs(self) -> list[dict[str, Any]]:
        return self._run_set().describe()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_run(self, path: str) -> str:
        """The active run's adapters, AdamW state and step (no base weights) into ``path``."""
        return self._run_set().save(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_run(self, path: str, optimizer: bool = True) -> int:
        """Restore a ``save_run`` directory into the active run; returns its step."""
        step = self._run_set().load(path, optimizer=optimizer)
        self._pending = None
        return step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_mesh(self) -> dict[str, Any]:
        out = self._engine().mesh()
        out["resumed_from"] = self.resumed_from
        out["warm_up_s"] = self.warm_up_s
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "rank": self.rank,
            "pid": os.getpid(),
            "initialized": self.engine is not None,
            "step": self.engine.step if self.engine is not None else None,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def shutdown(self) -> bool:
        """Destroy the engine's process groups (before the actors are killed)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        return True
