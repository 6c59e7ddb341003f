"""Checkpoints: one file per (tensor, pipeline) shard plus a ``meta.json`` completion marker.

Layout of a checkpoint directory::

    meta.json                 written last by rank 0: step, mesh sizes, model shape, format
                              (a LoRA engine's: also ``lora``, the adapter settings)
    shard_tp00_pp000.pt       model + optimizer state, step, RNG states of that shard
                              (a LoRA engine's: also ``lora`` and ``adapters``, this rank's
                              adapter state dict; ``optimizer`` is the adapters' AdamW state)

Only data-parallel rank 0 of each (tp, pp) shard writes (replicas hold the same state).
Every rank reads its own shard on load, so the loading group must have the same tensor
and pipeline sizes (the data-parallel size may differ). ``latest_checkpoint`` finds the
newest complete checkpoint under a root (``{root}/step_00000012/`` as the engine names
them, or the root itself).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from tgruntime.trainer.distributed import Mesh

__all__ = [
    "CHECKPOINT_FORMAT",
    "capture_rng",
    "latest_checkpoint",
    "read_meta",
    "read_shard",
    "restore_rng",
    "shard_path",
    "step_dirname",
    "write_meta",
    "write_shard",
]

CHECKPOINT_FORMAT = 1
META = "meta.json"


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def shard_path(path: str | Path, mesh: Mesh) -> Path:
    return Path(path) / f"shard_tp{mesh.tp_rank:02d}_pp{mesh.pp_rank:03d}.pt"


def capture_rng() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    # RNG states are CPU byte tensors, whatever map_location moved them to.
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
        tensor_parallel.get_cuda_rng_tracker().set_states(
            {
                k: v.cpu() if isinstance(v, torch.Tensor) else v
                for k, v in state["cuda_tracker"].items()
            }
        )


def write_shard(path: str | Path, mesh: Mesh, payload: dict[str, Any]) -> None:
    """Atomically write this rank's shard (callers pick which ranks write)."""
    target = shard_path(path, mesh)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, target)


def write_meta(path: str | Path, meta: dict[str, Any]) -> None:
    target = Path(path) / META
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": CHECKPOINT_FORMAT, **meta}, indent=2, sort_keys=True))
    os.replace(tmp, target)


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_file = Path(path) / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {META})")
    meta: dict[str, Any] = json.loads(meta_file.read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{path}: checkpoint format {meta.get('format')} is not {CHECKPOINT_FORMAT}"
        )
    return meta


def read_shard(path: str | Path, mesh: Mesh, *, map_location: torch.device) -> dict[str, Any]:
    # Our own files: they hold RNG states and optimizer scalars, so not weights_only.
    payload: dict[str, Any] = torch.load(
        shard_path(path, mesh), map_location=map_location, weights_only=False
    )
    return payload


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint in ``root`` (by step), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    if (root / META).is_file():
        return root
    best: tuple[int, float, Path] | None = None
    for child in root.iterdir():
        meta_file = child / META
        if not meta_file.is_file():
            continue
        try:
            step = int(json.loads(meta_file.read_text()).get("step", -1))
        except (ValueError, OSError):
            continue
        key = (step, meta_file.stat().st_mtime, child)
        if best is None or key[:2] > best[:2]:
            best = key
    return best[2] if best else None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
