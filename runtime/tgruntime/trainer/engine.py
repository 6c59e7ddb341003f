"""``TrainEngine``: one rank of a Megatron GPT training job, without Ray.

It owns this process's share of the work: torch.distributed and megatron's model-parallel
groups, the model stage, the optimizer, the step counter and checkpoints. Every rank of
the job calls the same methods in the same order (they are collective). The Ray worker
(``worker.py``) and the direct benchmark (``bench/bench_step.py``) both drive it, so the
group path and the direct path run exactly the same step.

LoRA (``create(lora=LoraSettings(rank>0))``): the model is built as usual, adapters are
injected and the base frozen, and the optimizer is built over the adapter parameters only
(``lora.build_adapter_training_state``): no megatron DDP, no full-weight optimizer or fp32
master copy is ever made. Checkpoints then also hold the adapters (and the optimizer state
is the adapters'). Rank 0 or no settings: a full-weight run, exactly as without the option.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from tgapi import TrainerGroupSpec, to_wire
from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.distributed import (
    Mesh,
    current_mesh,
    destroy_parallel,
    init_model_parallel,
    init_process_group,
    select_device,
)
from tgruntime.trainer.hf_weights import LlamaShape
from tgruntime.trainer.lora import (
    LoraAdapters,
    LoraSettings,
    build_adapter_training_state,
    inject_lora,
)
from tgruntime.trainer.model import (
    build_gpt_model,
    count_parameters,
    seed_everything,
    transformer_config,
)
from tgruntime.trainer.optim import (
    TrainingState,
    apply_optimizer_spec,
    build_training_state,
    reset_optimizer_state,
)
from tgruntime.trainer.primitives import (  # noqa: F401 (tests import the helper from here)
    Primitives,
    _default_micro_batch_size,
)
from tgruntime.trainer.schedule import ForwardBackwardFunc, select_forward_backward
from tgruntime.trainer.settings import RuntimeSettings, resolve_settings
from tgruntime.trainer.token_batch import token_batch
from tgruntime.trainer.token_budget import activation_bytes_per_token, auto_budget

__all__ = ["StepResult", "TrainEngine"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepResult:
    """One optimizer step as seen by one rank (identical on every rank of a data shard)."""

    step: int  # optimizer steps taken so far, this one included
    per_sample_loss: tuple[float, ...]  # mean next-token loss of each local sample
    loss: float  # token-weighted mean over the local batch
    grad_norm: float  # global L2 norm before clipping
    tokens: int  # tokens fed to the model on this data-parallel shard (B_local x S)
    step_time_s: float  # wall time of the whole step (device synchronised)
    lr: float
    skipped: bool = False  # the optimizer skipped the update (fp16 overflow / non-finite grads)

    def metrics(self) -> dict[str, Any]:
        """Scalars only (what the worker puts into ``meta_info``)."""
        out = dataclasses.asdict(self)
        out.pop("per_sample_loss")
        return out


class TrainEngine(Primitives):
    """One rank of a tensor/pipeline/data-parallel GPT training job."""

    def __init__(
        self,
        *,
        spec: TrainerGroupSpec,
        settings: RuntimeSettings,
        device: torch.device,
        state: TrainingState,
        forward_backward: ForwardBackwardFunc,
        micro_batch_size: int | None,
        owns_process_group: bool,
        lora: LoraSettings | None = None,
        adapters: LoraAdapters | None = None,
    ) -> None:
        self.spec = spec
        self.lora = lora  # the adapters' settings (None: a full-weight run)
        self.adapters = adapters  # this rank's adapters (None: a full-weight run)
        self.settings = settings
        self.device = device
        self.state = state
        self.step = 0
        self._forward_backward = forward_backward
        self._micro_batch_size = micro_batch_size
        self._token_budget, self._token_budget_source, self._per_token = _token_budget(
            spec, settings, device
        )
        self._owns_process_group = owns_process_group
        self._mesh = current_mesh()
        self._closed = False

    # -- construction ---------------------------------------------------------------
    @classmethod
    def create(
        cls,
        *,
        spec: TrainerGroupSpec,
        backend: str | None = None,
        device: str | None = None,
        micro_batch_size: int | None = None,
        lora: LoraSettings | None = None,
    ) -> TrainEngine:
        """Join the job (process group from the environment) and build model + optimizer.

        ``backend`` overrides nccl/gloo; ``device`` forces "cuda"/"cpu" (default: GPU when
        ``workers.useGpu`` and CUDA is present); ``micro_batch_size`` overrides the
        micro-batch split (default: the whole local batch, or 2 x stages micro-batches
        with pipeline parallelism).

        ``lora`` with ``rank > 0``: LoRA adapters on the model (docs/lora.md), the base
        frozen, AdamW over the adapters only (the full-weight optimizer is never built).
        ``None`` or rank 0: a full-weight run. Settings the model cannot take (not a
        Llama-shaped model, a rank beyond a projection, fp16, key/value groups not split by
        the TP size) raise ``ValueError`` naming the field, before anything is left built.
        """
        p = spec.parallelism
        if p.context != 1:
            raise ValueError(
                "parallelism.context > 1 needs Transformer Engine's context-parallel attention, "
                "which the built-in trainer (SDPA core attention) does not use; set it to 1"
            )
        if p.expert != 1:
            raise ValueError(
                "parallelism.expert must be 1: the built-in trainer builds dense models"
            )
        settings = resolve_settings(spec, backend=backend, device=device)
        lora = lora if lora is not None and lora.enabled else None
        shape = _lora_shape(spec, settings, lora) if lora is not None else None
        torch_device = select_device(settings)
        owns = init_process_group(settings)
        adapters: LoraAdapters | None = None
        try:
            init_model_parallel(tp=p.tensor, pp=p.pipeline, cp=p.context)
            ckpt.init_io_group()  # the long-timeout gloo group of checkpoint waits
            seed_everything(spec.model.seed, settings=settings)
            config = transformer_config(spec.model, p, settings)
            module = build_gpt_model(spec.model, config, settings)
            state: TrainingState
            if lora is not None and shape is not None:
                adapters = inject_lora(module, settings=lora, shape=shape)
                state = build_adapter_training_state(
                    module, adapters=adapters, config=config, spec=spec.optimizer
                )
            else:
                state = build_training_state(
                    module, config=config, spec=spec.optimizer, settings=settings
                )
        except BaseException:
            ckpt.destroy_io_group()
            destroy_parallel(destroy_process_group=owns)
            raise
        return cls(
            spec=spec,
            settings=settings,
            device=torch_device,
            state=state,
            forward_backward=select_forward_backward(on_gpu=settings.on_gpu),
            micro_batch_size=micro_batch_size,
            owns_process_group=owns,
            lora=lora,
            adapters=adapters,
        )

    # -- introspection --------------------------------------------------------------
    @property
    def mesh_info(self) -> Mesh:
        return self._mesh

    def mesh(self) -> dict[str, Any]:
        """This rank's place in the tp/pp/cp/dp grid, whether it is collected, and the setup."""
        out = self._mesh.to_dict()
        out.update(
            device=str(self.device),
            dtype=self.settings.dtype_name,
            backend=self.settings.backend,
            position_embedding=self.settings.position_embedding,
            vocab_size=self.spec.model.vocab_size,
            parameters=count_parameters(self.state.module),
            step=self.step,
        )
        if self.lora is not None and self.adapters is not None:  # absent on full-weight runs
            out.update(
                lora=self.lora.to_dict(),
                adapter_parameters=count_parameters(self.adapters),
            )
        return out

    # -- LoRA runs ------------------------------------------------------------------
    def build_adapters(self, lora: LoraSettings) -> tuple[LoraAdapters, TrainingState]:
        """A new adapter set with its own AdamW on this engine's frozen base (many runs on
        one group: ``lora.runs``). The new adapters are attached: detach the active run's
        first. ``ValueError`` naming the field when ``lora`` does not fit the model."""
        self._check_open()
        if self.adapters is None:
            raise ValueError(
                "this group trains full weights: LoRA runs need a LoRA group (set spec.lora)"
            )
        if not lora.enabled:
            raise ValueError("lora.rank must be at least 1 for a LoRA run")
        shape = _lora_shape(self.spec, self.settings, lora)
        module = self.state.module
        adapters = inject_lora(module, settings=lora, shape=shape)
        try:
            state = build_adapter_training_state(
                module, adapters=adapters, config=module.config, spec=self.spec.optimizer
            )
        except BaseException:
            adapters.detach()
            raise
        return adapters, state

    def base_fingerprint(self) -> str:
        """What identifies the frozen base an adapter was trained on: the model section of
        the spec (shape, seed, pretrained source) as a short hash."""
        import hashlib
        import json

        model = to_wire(self.spec.model)
        blob = json.dumps(model, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # -- training -------------------------------------------------------------------
    def train_step(self, input_ids: torch.Tensor) -> StepResult:
        """Forward, next-token loss, backward and one optimizer step on ``input_ids`` [B, S]:
        ``zero_grad`` -> ``forward_backward("cross_entropy")`` -> ``optim_step``."""
        self._check_open()
        self._sync()
        start = time.perf_counter()
        batch = token_batch(
            {"input_ids": input_ids}, device=self.device, vocab_size=self.spec.model.vocab_size
        )
        self.zero_grad()
        fb = self.forward_backward(batch, loss="cross_entropy")
        opt = self.optim_step()
        self._sync()
        return StepResult(
            step=opt.step,
            per_sample_loss=fb.per_sample_loss,
            loss=fb.local_loss,
            grad_norm=opt.grad_norm,
            tokens=batch.batch_size * batch.seq_length,
            step_time_s=time.perf_counter() - start,
            lr=opt.lr,
            skipped=opt.skipped,
        )

    # -- checkpoints ----------------------------------------------------------------
    def default_checkpoint_path(self) -> Path | None:
        root = self.spec.training.checkpoint_dir
        return Path(root) / ckpt.step_dirname(self.step) if root else None

    def save_checkpoint(self, path: str | Path | None = None) -> str:
        """Write model + optimizer state, step and RNG of every shard into directory ``path``.

        A LoRA engine also writes its adapters and settings (the optimizer state is the
        adapters'; the frozen base is written too, so a resume needs nothing else).

        Default: ``{training.checkpointDir}/step_{step:08d}``. Collective; returns the path.

        The shard writers save synchronously; the other ranks wait on the checkpoint I/O
        group (``TG_CHECKPOINT_TIMEOUT_S``, default 2 hours), never on the training group's
        NCCL timeout. After a save into ``checkpointDir`` rank 0 keeps only the newest
        ``keepCheckpoints`` complete checkpoints there (``checkpoint.keep_checkpoints``).
        """
        self._check_open()
        target = Path(path) if path is not None else self.default_checkpoint_path()
        if target is None:
            raise ValueError("no checkpoint path given and training.checkpointDir is empty")
        mesh = self._mesh
        if mesh.dp_rank == 0 and mesh.cp_rank == 0:
            payload: dict[str, Any] = {
                "model": self.state.module.state_dict(),
                "optimizer": self.state.optimizer.state_dict(),
                "step": self.step,
                "rng": ckpt.capture_rng(),
                "mesh": mesh.to_dict(),
            }
            if self.lora is not None and self.adapters is not None:
                payload["lora"] = self.lora.to_dict()
                payload["adapters"] = self.adapters.state_dict()
            ckpt.write_shard(target, mesh, payload)
        ckpt.barrier()
        if mesh.rank == 0:
            meta: dict[str, Any] = {
                "step": self.step,
                "tp": mesh.tp_size,
                "pp": mesh.pp_size,
                "dp": mesh.dp_size,
                "dtype": self.settings.dtype_name,
                "position_embedding": self.settings.position_embedding,
                "model": to_wire(self.spec.model),
            }
            if self.lora is not None:
                meta["lora"] = self.lora.to_dict()
            ckpt.write_meta(target, meta)
            root = self.spec.training.checkpoint_dir
            keep = ckpt.keep_checkpoints(self.spec)
            if (
                keep
                and root
                and ckpt.is_step_dir(target)
                and target.resolve().parent == Path(root).resolve()
            ):
                ckpt.prune(root, keep, saved=target)
        ckpt.barrier()
        return str(target)

    def load_checkpoint(
        self, path: str | Path, *, optimizer: bool = True, step: int | None = None
    ) -> int:
        """Restore the state written by :meth:`save_checkpoint`; returns the restored step.

        ``optimizer=False``: the weights (and step, RNG) only; the optimizer starts fresh
        (Adam's moments forgotten; megatron's fp32 main params re-copied from the weights).

        A LoRA engine restores its adapters too; the checkpoint must hold adapters of the
        same rank, alpha and switches (the seed may differ: it only picks the initial ``A``).
        A full-weight checkpoint does not load into a LoRA engine, nor the reverse.

        Collective check first: a rank that cannot read ``meta.json`` or its own shard, or
        whose ``meta.json`` is of another step than rank 0's (``step``, when given, is the
        one expected), makes every rank raise ``CheckpointUnreadableError`` naming its path,
        step and node.
        """
        self._check_open()
        step = ckpt.verify_readable(path, step=step, mesh=self._mesh)
        meta = ckpt.read_meta(path)
        self._check_lora_checkpoint(path, meta.get("lora"))
        mesh = self._mesh
        if (meta["tp"], meta["pp"]) != (mesh.tp_size, mesh.pp_size):
            raise ValueError(
                f"{path} was written with tensor={meta['tp']} pipeline={meta['pp']}; this group "
                f"has tensor={mesh.tp_size} pipeline={mesh.pp_size}"
            )
        if meta.get("position_embedding") != self.settings.position_embedding:
            raise ValueError(
                f"{path} holds a model with {meta.get('position_embedding')} positions; this "
                f"group uses {self.settings.position_embedding} (set model.positionEmbedding)"
            )
        payload = ckpt.read_shard_agreed(path, mesh, map_location=self.device, step=step)
        self.state.module.load_state_dict(payload["model"], strict=True)
        if self.adapters is not None:
            self.adapters.load_state_dict(payload["adapters"], strict=True)
        if optimizer:
            self.state.optimizer.load_state_dict(payload["optimizer"])
        else:
            reset_optimizer_state(self.state.optimizer)
        apply_optimizer_spec(self.state.optimizer, self.spec.optimizer)
        ckpt.restore_rng(payload["rng"])
        self.step = int(payload["step"])
        self._accumulated, self._grads_stale = 0.0, True  # a loaded state has no gradient
        self._reduction = None
        ckpt.barrier()
        return self.step

    def _check_lora_checkpoint(self, path: str | Path, saved: Any) -> None:
        """Refuse a checkpoint whose adapters (or their absence) do not fit this engine."""
        mine = self.lora
        if saved is None and mine is None:
            return
        if mine is not None and saved is None:
            raise ValueError(
                f"{path} is a full-weight checkpoint (no LoRA adapters); this engine trains "
                f"LoRA adapters (rank {mine.rank}): load it into a full-weight group, or "
                "import its weights as the base (export_hf there, then import_hf here)"
            )
        theirs = LoraSettings.from_mapping(saved)
        if mine is None:
            raise ValueError(
                f"{path} holds LoRA adapters (rank {theirs.rank}); this engine trains full "
                "weights: create it with the same LoRA settings to load it"
            )
        for field in ("rank", "alpha", "train_attn", "train_mlp", "train_unembed"):
            if getattr(theirs, field) != getattr(mine, field):
                raise ValueError(
                    f"{path}: its adapters have lora.{field} {getattr(theirs, field)!r}; this "
                    f"engine's have {getattr(mine, field)!r}"
                )

    def load_latest_checkpoint(self) -> int | None:
        """Load the newest complete checkpoint under ``training.checkpointDir``, if any
        (:meth:`resume`); returns its step."""
        return self.step if self.resume() is not None else None

    def resume(self) -> str | None:
        """Collective: resume from the one checkpoint rank 0 chooses; returns its path here.

        Each rank first removes the temporary files interrupted saves left under
        ``training.checkpointDir`` (its own names only), then rank 0 picks its newest
        complete checkpoint and broadcasts the step; every rank loads that step from its own
        ``checkpointDir``, or the group fails with ``CheckpointUnreadableError`` (path, step,
        node) when a rank cannot read it. None (on every rank) when rank 0 has none."""
        self._check_open()
        root = self.spec.training.checkpoint_dir
        if not root:
            return None
        ckpt.clean_stray_temps(root, self._mesh)
        chosen = ckpt.agree_on_resume(root)
        if chosen is None:
            return None
        path, step = chosen
        self.load_checkpoint(path, step=step)
        return str(path)

    # -- teardown -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this TrainEngine was shut down")

    def shutdown(self) -> None:
        """Destroy megatron's groups (and the default group when this engine created it)."""
        if self._closed:
            return
        self._closed = True
        ckpt.destroy_io_group()
        destroy_parallel(destroy_process_group=self._owns_process_group)
        if self.settings.on_gpu:
            torch.cuda.empty_cache()


def _token_budget(
    spec: TrainerGroupSpec, settings: RuntimeSettings, device: torch.device
) -> tuple[int, str, int | None]:
    """(tokens per micro-batch at start, where that number comes from, the activation bytes
    per token when the budget is chosen again for every call from free memory, else None) for
    token_budget.py."""
    tokens = spec.training.micro_batch_tokens
    if tokens > 0:
        return tokens, f"spec.training.microBatchTokens {tokens}", None
    if not settings.on_gpu:
        return 0, "no limit on CPU", None
    free, _total = torch.cuda.mem_get_info(device)
    m, p = spec.model, spec.parallelism
    per_token = activation_bytes_per_token(
        hidden=m.hidden_size,
        layers_local=max(1, m.num_layers // p.pipeline),
        vocab=m.vocab_size,
        tp=p.tensor,
        element_bytes=settings.dtype.itemsize,
    )
    budget = auto_budget(free_bytes=free, per_token=per_token)
    return budget, (
        f"chosen from {free / 2**30:.1f} GiB of free GPU memory at start, "
        f"~{per_token / 2**10:.0f} KiB of activations per token; "
        "spec.training.microBatchTokens sets it"
    ), per_token


def _lora_shape(
    spec: TrainerGroupSpec, settings: RuntimeSettings, lora: LoraSettings
) -> LlamaShape:
    """The Llama shape LoRA needs, checked before anything is built (a ``ValueError``
    naming the field otherwise)."""
    if settings.dtype == torch.float16:
        raise ValueError(
            "lora: LoRA training needs model.dtype bfloat16 or float32 (float16 would need "
            "loss scaling, which the adapters' optimizer does not do)"
        )
    try:
        shape = LlamaShape.from_model_spec(
            spec.model, position_embedding=settings.position_embedding
        )
    except ValueError as exc:
        raise ValueError(f"lora: the adapters follow Hugging Face Llama's layout: {exc}") from None
    lora.check_shape(shape)
    return shape
