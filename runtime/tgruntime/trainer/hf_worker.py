"""Hugging Face weights (Llama, Qwen2, Qwen3: ``model.architecture``) out of and into a
running trainer group.

:class:`HFWeightsMixin` gives ``MegatronTrainer`` two group methods (``ONE_TO_ALL``: every
rank takes part):

* ``export_hf(path)``: the tensor-parallel shards of each pipeline stage are gathered to the
  stage's first tensor rank and merged, converted to Hugging Face names (``hf_weights``) and
  sent to global rank 0, the one writer, which writes ``model.safetensors`` (or shards of at
  most ``max_shard_bytes`` plus an index) and then ``config.json``, loadable with
  ``LlamaForCausalLM.from_pretrained(path)`` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``).
  Only data-parallel replica 0 sends weights. The path needs to exist only on rank 0's
  machine.
* ``import_hf(path)``: every rank reads, from the same directory (shared storage when ranks
  are on several machines), just the tensors of its pipeline stage and copies its tensor
  slice into its parameters. The optimizer's moments are cleared and accumulated gradients
  dropped (a new starting point), and megatron's fp32 master copies are refreshed.

Both return a summary dict with the wall time (``seconds``, measured on each rank). The
functions :func:`export_hf_checkpoint` and :func:`import_hf_checkpoint` do the work on a
:class:`TrainEngine` directly (no Ray), for the benchmark and tests.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from tgruntime.controller import Dispatch, register
from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer import hf_files
from tgruntime.trainer.engine import TrainEngine
from tgruntime.trainer.hf_weights import (
    LlamaShape,
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    renumber_layers,
    tp_merge,
    tp_split,
)
from tgruntime.trainer.lora.inject import LoraAdapters

__all__ = [
    "HFWeightsMixin",
    "export_hf_checkpoint",
    "export_merged_lora",
    "import_hf_checkpoint",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFWeightsMixin:
    """``export_hf`` / ``import_hf`` group methods for a worker that owns a ``TrainEngine``."""

    def _engine(self) -> TrainEngine:  # MegatronTrainer provides the real one
        raise NotImplementedError

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(
        self,
        path: str,
        *,
        dtype: str | None = None,
        max_shard_bytes: int = hf_files.DEFAULT_MAX_SHARD_BYTES,
    ) -> dict[str, Any]:
        """Write the model as a Hugging Face checkpoint (its architecture's class) into ``path``.

        ``dtype`` ("float32", "bfloat16", "float16"; default the model's own) is the dtype of
        the files. Returns path, files, bytes, dtype, seconds (this rank's wall time) and
        write_seconds (rank 0's time writing files).
        """
        return export_hf_checkpoint(
            self._engine(), path=path, dtype=dtype, max_shard_bytes=max_shard_bytes
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def import_hf(self, path: str, *, reset_optimizer: bool = True) -> dict[str, Any]:
        """Load weights from a Hugging Face checkpoint directory into this group.

        ``config.json`` must describe this group's model shape. With ``reset_optimizer``
        (default) Adam's moments are cleared. Returns path, parameters, seconds.
        """
        return import_hf_checkpoint(self._engine(), path=path, reset_optimizer=reset_optimizer)


# -- shared by both directions -------------------------------------------------------
def _llama_shape(engine: TrainEngine) -> LlamaShape:
    return LlamaShape.from_model_spec(
        engine.spec.model, position_embedding=engine.settings.position_embedding, llama_only=False
    )


def _stage_layers(module: torch.nn.Module) -> range:
    """Global indices of the layers this pipeline stage holds (megatron's 1-based layer_number)."""
    layers = list(module.decoder.layers)  # type: ignore[union-attr, arg-type]
    if not layers:
        return range(0)
    first = int(layers[0].layer_number) - 1
    return range(first, first + len(layers))


def _stage_params(
    module: torch.nn.Module, layers: range, shape: LlamaShape
) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters by name, checked against the layout of its stage."""
    params = dict(module.named_parameters())
    expected = megatron_names(
        layers=range(len(layers)),
        first_stage=parallel_state.is_pipeline_first_stage(),
        last_stage=parallel_state.is_pipeline_last_stage(),
        shape=shape,
    )
    if set(params) != set(expected):
        extra = sorted(set(params) - set(expected))
        lacking = sorted(set(expected) - set(params))
        raise ValueError(
            f"the model's parameters do not follow the {shape.architecture} layout (extra "
            f"{extra[:3]}, "
            f"missing {lacking[:3]})"
        )
    return {name: params[name] for name in expected}


# -- export ------------------------------------------------------------------------
def _gather_stage(
    params: dict[str, torch.nn.Parameter], *, dtype: torch.dtype, offset: int
) -> dict[str, torch.Tensor] | None:
    """Merge this stage's tensor-parallel shards on its first tensor rank (others get None)."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    dst = parallel_state.get_tensor_model_parallel_src_rank()
    full: dict[str, torch.Tensor] = {}
    for name, param in params.items():
        local = param.detach().to(dtype).contiguous()
        if tp_size == 1:
            full[name] = local
            continue
        shards = [torch.empty_like(local) for _ in range(tp_size)] if tp_rank == 0 else None
        dist.gather(local, shards, dst=dst, group=group)
        if shards is not None:
            full[name] = tp_merge(name, shards)
    return renumber_layers(full, offset=offset) if tp_rank == 0 else None


def _send_stage(hf: dict[str, torch.Tensor], *, dst: int, group: Any) -> None:
    meta = [(name, tuple(t.shape)) for name, t in hf.items()]
    dist.send_object_list([meta], dst=dst, group=group)
    for tensor in hf.values():
        dist.send(tensor.contiguous(), dst=dst, group=group)


def _recv_stage(
    *, src: int, group: Any, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    out: dict[str, torch.Tensor] = {}
    for name, shape in box[0]:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=src, group=group)
        out[name] = buf.cpu()
    return out


class _Writer:
    """Rank 0's side: writes each planned file as soon as all its tensors have arrived."""

    def __init__(self, root: Path, shape: LlamaShape, *, dtype: torch.dtype, max_bytes: int):
        self.root = root
        size = torch.empty((), dtype=dtype).element_size()
        sizes = [(n, size * _numel(s)) for n, s in shape.hf_shapes().items()]
        self.plan = hf_files.plan_shards(sizes, max_shard_bytes=max_bytes)
        self.files = hf_files.shard_names(len(self.plan))
        self.pending: dict[str, torch.Tensor] = {}
        self.written = 0
        self.bytes = 0
        self.seconds = 0.0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        while self.written < len(self.plan) and all(
            n in self.pending for n in self.plan[self.written]
        ):
            start = time.perf_counter()
            part = {n: self.pending.pop(n) for n in self.plan[self.written]}
            self.bytes += hf_files.write_shard(self.root / self.files[self.written], part)
            self.seconds += time.perf_counter() - start
            self.written += 1

    def finish(self, config: dict[str, Any]) -> None:
        if self.written != len(self.plan) or self.pending:
            raise RuntimeError(
                f"export_hf: wrote {self.written} of {len(self.plan)} files; "
                f"{len(self.pending)} tensors left unwritten"
            )
        start = time.perf_counter()
        if len(self.files) > 1:
            weights = {n: f for f, names in zip(self.files, self.plan, strict=True) for n in names}
            hf_files.write_index(self.root, weights=weights, total_size=self.bytes)
        hf_files.write_config(self.root, config)  # last: marks the directory complete
        self.seconds += time.perf_counter() - start


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def export_hf_checkpoint(
    engine: TrainEngine,
    *,
    path: str,
    dtype: str | None = None,
    max_shard_bytes: int = hf_files.DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Collective: write ``engine``'s model as a Hugging Face checkpoint (see module doc)."""
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    shape = _llama_shape(engine)
    out_dtype = _DTYPES[dtype] if dtype else engine.settings.dtype
    start = time.perf_counter()
    if engine.settings.on_gpu:
        torch.cuda.synchronize(engine.device)
    mesh = engine.mesh_info
    module = engine.state.module
    root = Path(path)
    writer: _Writer | None = None
    if mesh.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        hf_files.clear_weights(root)
        writer = _Writer(root, shape, dtype=out_dtype, max_bytes=max_shard_bytes)
    if mesh.dp_rank == 0 and mesh.cp_rank == 0:
        layers = _stage_layers(module)
        params = _stage_params(module, layers, shape)
        full = _gather_stage(params, dtype=out_dtype, offset=layers.start)
        if full is not None:  # first tensor rank of this stage
            hf = megatron_to_hf(full, shape)
            del full
            pp_group = parallel_state.get_pipeline_model_parallel_group()
            pp_ranks = dist.get_process_group_ranks(pp_group) if mesh.pp_size > 1 else [0]
            if writer is not None:
                writer.add({n: t.cpu() for n, t in hf.items()})
                del hf
                for src in pp_ranks[1:]:
                    writer.add(
                        _recv_stage(src=src, group=pp_group, dtype=out_dtype, device=engine.device)
                    )
                writer.finish(shape.hf_config(dtype=out_dtype))
            else:
                _send_stage(hf, dst=pp_ranks[0], group=pp_group)
    summary: list[Any] = [None]
    if writer is not None:
        summary[0] = {
            "path": str(root),
            "files": list(writer.files),
            "bytes": writer.bytes,
            "dtype": str(out_dtype).removeprefix("torch."),
            "write_seconds": writer.seconds,
        }
    # also the barrier (every file is written): on the checkpoint I/O group, whose timeout
    # (TG_CHECKPOINT_TIMEOUT_S) outlasts a slow write, not the training group's
    dist.broadcast_object_list(summary, src=0, group=ckpt.io_group())
    result: dict[str, Any] = dict(summary[0])
    result.update(rank=mesh.rank, seconds=time.perf_counter() - start)
    return result


# -- import ------------------------------------------------------------------------
def _reset_optimizer(engine: TrainEngine) -> None:
    optimizer: Any = engine.state.optimizer
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            inner.state.clear()


def import_hf_checkpoint(
    engine: TrainEngine, *, path: str, reset_optimizer: bool = True
) -> dict[str, Any]:
    """Collective: load a Hugging Face checkpoint into ``engine``'s model shards."""
    start = time.perf_counter()
    shape = _llama_shape(engine)
    config_shape = LlamaShape.from_hf_config(hf_files.read_config(path))
    shape.check_compatible(config_shape, source=f"{path}/config.json")
    mesh = engine.mesh_info
    module = engine.state.module
    layers = _stage_layers(module)
    params = _stage_params(module, layers, shape)
    names = hf_names(
        layers=layers,
        first_stage=parallel_state.is_pipeline_first_stage(),
        last_stage=parallel_state.is_pipeline_last_stage(),
        shape=shape,
    )
    full = renumber_layers(
        hf_to_megatron(hf_files.read_tensors(path, names), shape), offset=-layers.start
    )
    with torch.no_grad():
        for name, param in params.items():
            shard = tp_split(name, full[name], tp_size=mesh.tp_size, tp_rank=mesh.tp_rank)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{name}: the checkpoint gives a shard of shape {tuple(shard.shape)} for "
                    f"tensor rank {mesh.tp_rank}; the parameter is {tuple(param.shape)}"
                )
            param.copy_(shard)
    engine.zero_grad()  # a new starting point: no accumulated gradient
    if reset_optimizer:
        _reset_optimizer(engine)
    reload = getattr(engine.state.optimizer, "reload_model_params", None)
    if reload is not None:  # megatron's mixed-precision optimizer: refresh its fp32 copies
        reload()
    if engine.settings.on_gpu:
        torch.cuda.synchronize(engine.device)
    ckpt.barrier()  # every rank has read its part (slow storage: the long timeout)
    return {
        "path": str(path),
        "rank": mesh.rank,
        "parameters": sum(p.numel() for p in params.values()),
        "seconds": time.perf_counter() - start,
    }


# -- LoRA: the merged export (here, not in lora/, which the engine imports) --------------
def export_merged_lora(
    engine: Any, adapters: LoraAdapters, path: str | Path, *, dtype: str | None = None
) -> dict[str, Any]:
    """Collective: write ``engine``'s model with the adapters folded in
    (``W + scaling * B @ A``) as a Hugging Face checkpoint; the weights are restored after."""
    module = engine.state.module
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for name, adapter in adapters.items():
                weight = module.get_submodule(name).weight
                saved.append((weight, weight.detach().clone()))
                weight.add_(adapter.delta_weight().to(weight.dtype))
        return export_hf_checkpoint(engine, path=str(path), dtype=dtype)
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)
