"""Adapter weights in and out: per-rank state, full (gathered) tensors, PEFT files, merged HF.

* :func:`save_adapter_state` / :func:`load_adapter_state`: each rank's own shards
  (``adapter_tp{TT}_pp{PPP}.pt``, data-parallel replica 0 writes), restored by the same
  layout; the settings and the layout are checked.
* :func:`gather_full` (collective): every adapter tensor (or its gradient) unsharded, under
  peft's names (``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``, global
  layer numbers), on global rank 0 (None elsewhere). :func:`load_full` is the inverse: each
  rank takes its shard of the tensors of its own stage.
* :func:`export_peft` writes ``adapter_config.json`` + ``adapter_model.safetensors`` that
  ``peft.PeftModel.from_pretrained(LlamaForCausalLM..., path)`` loads; :func:`import_peft`
  reads them back (the config must match the settings).
* the merged export (full Hugging Face weights of ``W + scaling * B @ A``) is
  ``hf_worker.export_merged_lora``: it needs the engine, which imports this package.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open

from tgruntime.trainer import hf_files
from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.settings import LoraSettings
from tgruntime.trainer.safe_load import load_state

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "adapter_config",
    "export_peft",
    "gather_full",
    "import_peft",
    "load_adapter_state",
    "load_full",
    "peft_names",
    "read_peft",
    "save_adapter_state",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _peft_name(hf_module: str, which: str) -> str:
    return f"{PEFT_PREFIX}{hf_module}.lora_{which}.weight"


def peft_names(adapters: LoraAdapters) -> list[str]:
    """The peft tensor names this rank's adapters hold a part of."""
    return [
        _peft_name(p.hf_module, which)
        for _, adapter in adapters.items()
        for p in adapter.parts
        for which in ("A", "B")
    ]


def _barrier() -> None:
    # the checkpoint I/O group's long timeout: a slow save never trips the NCCL one
    from tgruntime.trainer.checkpoint import barrier

    barrier()


# -- per-rank state -----------------------------------------------------------------
def _shard_file(path: Path) -> Path:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return path / f"adapter_tp{tp:02d}_pp{pp:03d}.pt"


def _layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
    }


def save_adapter_state(adapters: LoraAdapters, path: str | Path) -> str:
    """Collective: write this rank's adapter shards into directory ``path``; returns it."""
    root = Path(path)
    if parallel_state.get_data_parallel_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        payload = {
            "settings": adapters.settings.to_dict(),
            "layout": _layout(),
            "state": {k: v.detach().cpu().clone() for k, v in adapters.state_dict().items()},
        }
        target = _shard_file(root)
        tmp = target.with_name(target.name + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(target)
    _barrier()
    return str(root)


def load_adapter_state(adapters: LoraAdapters, path: str | Path) -> None:
    """Collective: restore what :func:`save_adapter_state` wrote (same settings and layout)."""
    target = _shard_file(Path(path))
    if not target.is_file():
        raise FileNotFoundError(f"{target} not found (written with another TP/PP layout?)")
    payload = load_state(target, what="LoRA adapter state")
    saved = LoraSettings.from_mapping(payload["settings"])
    if saved != adapters.settings:
        raise ValueError(f"{path} holds an adapter of {saved}; this one is {adapters.settings}")
    if payload["layout"] != _layout():
        raise ValueError(f"{path} was written with layout {payload['layout']}, not {_layout()}")
    with torch.no_grad():
        current = adapters.state_dict()
        missing = sorted(set(current) - set(payload["state"]))
        if missing:
            raise KeyError(f"{target} lacks {missing[:3]}")
        for name, tensor in current.items():
            tensor.copy_(payload["state"][name])
    _barrier()


# -- full tensors ---------------------------------------------------------------------
def _local_pieces(adapters: LoraAdapters, *, grads: bool) -> list[tuple[str, int | None, Any]]:
    out: list[tuple[str, int | None, Any]] = []
    for _, adapter in adapters.items():
        for part in adapter.parts:
            key = part.hf_module.rsplit(".", 1)[-1]
            for which, table in (("A", adapter.lora_A), ("B", adapter.lora_B)):
                param = table[key]
                value = param.grad if grads else param.data
                if value is None:
                    raise ValueError(f"{part.hf_module}.lora_{which} has no gradient")
                out.append(
                    (_peft_name(part.hf_module, which), adapter.split_dim(which), value.cpu())
                )
    return out


def gather_full(adapters: LoraAdapters, *, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """Collective: every adapter tensor (``grads``: its gradient), full, under peft's names,
    on global rank 0 in float32; None on the other ranks."""
    send = parallel_state.get_data_parallel_rank() == 0
    local = {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pieces": _local_pieces(adapters, grads=grads) if send else [],
    }
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list[Any] = [None] * world if _rank() == 0 else []
    if world == 1:
        gathered = [local]
    else:
        dist.gather_object(local, gathered if _rank() == 0 else None, dst=0)
    if _rank() != 0:
        return None
    pieces: dict[str, dict[int, tuple[int | None, torch.Tensor]]] = {}
    for entry in gathered:
        for name, dim, tensor in entry["pieces"]:
            pieces.setdefault(name, {})[entry["tp_rank"]] = (dim, tensor)
    full: dict[str, torch.Tensor] = {}
    for name, by_rank in pieces.items():
        dims = {d for d, _ in by_rank.values()}
        shards = [by_rank[r][1] for r in sorted(by_rank)]
        (dim,) = dims
        full[name] = (shards[0] if dim is None else torch.cat(shards, dim=dim)).float()
    return dict(sorted(full.items(), key=lambda kv: _order(kv[0])))


def _order(name: str) -> tuple[int, str]:
    parts = name.removeprefix(PEFT_PREFIX).split(".")
    layer = int(parts[2]) if parts[:2] == ["model", "layers"] else 1 << 30
    return layer, name


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def load_full(adapters: LoraAdapters, tensors: Mapping[str, torch.Tensor]) -> None:
    """Set this rank's adapter shards from full tensors under peft's names (any stage's
    tensors may be present; the ones of this stage must be)."""
    missing = [n for n in peft_names(adapters) if n not in tensors]
    if missing:
        raise KeyError(f"the adapter weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for _, adapter in adapters.items():
            for part in adapter.parts:
                key = part.hf_module.rsplit(".", 1)[-1]
                for which, table in (("A", adapter.lora_A), ("B", adapter.lora_B)):
                    name = _peft_name(part.hf_module, which)
                    want = (
                        (adapter.rank, part.in_features)
                        if which == "A"
                        else (part.out_features, adapter.rank)
                    )
                    got = tuple(tensors[name].shape)
                    if got != want:
                        raise ValueError(f"{name}: shape {got}, expected {want}")
                    table[key].copy_(adapter.local_shard(which, tensors[name]))


# -- PEFT files -------------------------------------------------------------------------
def adapter_config(settings: LoraSettings, *, base_model: str = "") -> dict[str, Any]:
    """``adapter_config.json`` for peft's ``LoraConfig``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": 0.0,
        "target_modules": settings.hf_targets(),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft(
    adapters: LoraAdapters,
    path: str | Path,
    *,
    base_model: str = "",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Collective: write the adapter in PEFT's format into directory ``path`` (global rank 0
    writes; the path must exist there only). Returns path, tensors, bytes (on every rank)."""
    full = gather_full(adapters)
    summary: list[Any] = [None]
    if full is not None:
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        if dtype is not None:
            full = {n: t.to(dtype) for n, t in full.items()}
        size = hf_files.write_shard(root / ADAPTER_WEIGHTS, full)
        config = adapter_config(adapters.settings, base_model=base_model)
        tmp = root / (ADAPTER_CONFIG + ".tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.replace(root / ADAPTER_CONFIG)
        summary[0] = {"path": str(root), "tensors": len(full), "bytes": size}
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(summary, src=0)
    result: dict[str, Any] = summary[0]
    return result


def read_peft(path: str | Path) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """Settings and tensors of a PEFT LoRA directory (refuses what the adapters cannot be)."""
    root = Path(path)
    config_file = root / ADAPTER_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a PEFT adapter directory")
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    for field, want in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if config.get(field, want) != want:
            raise ValueError(f"{config_file}: {field} {config[field]!r} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{config_file}: target_modules as a regex is not supported")
    known = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    attn, mlp = {"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj"}
    unknown = sorted(set(targets) - known - {"lm_head"})
    if unknown:
        raise ValueError(f"{config_file}: target_modules {unknown} are not LoRA targets here")
    got = set(targets)
    for group in (attn, mlp):
        if got & group and not group <= got:
            raise ValueError(
                f"{config_file}: target_modules must hold all or none of {sorted(group)}"
            )
    settings = LoraSettings(
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", 8)),
        train_attn=bool(got & attn),
        train_mlp=bool(got & mlp),
        train_unembed="lm_head" in got,
    )
    with safe_open(str(root / ADAPTER_WEIGHTS), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return settings, tensors


def import_peft(adapters: LoraAdapters, path: str | Path) -> None:
    """Load a PEFT adapter directory into these adapters (rank, alpha, targets must match;
    the seed is irrelevant)."""
    settings, tensors = read_peft(path)
    mine = adapters.settings
    for field in ("rank", "alpha", "train_attn", "train_mlp", "train_unembed"):
        if getattr(settings, field) != getattr(mine, field):
            raise ValueError(
                f"{path}: lora.{field} is {getattr(settings, field)!r}; these adapters have "
                f"{getattr(mine, field)!r}"
            )
    load_full(adapters, tensors)
