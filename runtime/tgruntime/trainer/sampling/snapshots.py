"""Named weight snapshots for sampling while training goes on.

``SnapshotStore.save(name, module, path=None)`` keeps a device copy of this rank's
parameters under ``name`` (and, with ``path``, writes them with the checkpoint module's
shard writer: ``shard_tpXX_ppYYY.pt`` per (tensor, pipeline) shard, data-parallel rank 0
writes, then ``sampler_weights.json`` from rank 0 as the completion marker: a name that
``latest_checkpoint`` never mistakes for a training checkpoint). ``swapped_in(name)``
copies a snapshot into the live parameters for the duration of a ``with`` block and copies
the training values back afterwards, bit for bit, so CUDA graphs captured over the live
parameters serve every snapshot. Memory: one copy of this rank's parameters per snapshot,
plus one transient copy of the training weights while a snapshot is swapped in.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.distributed import Mesh

__all__ = ["MARKER", "SnapshotStore"]

MARKER = "sampler_weights.json"


class SnapshotStore:
    """This rank's named parameter snapshots."""

    def __init__(self) -> None:
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}

    def names(self) -> list[str]:
        return sorted(self._snapshots)

    def save(
        self, name: str, module: torch.nn.Module, mesh: Mesh, path: str | None = None
    ) -> dict[str, Any]:
        """Collective when ``path`` is given (a barrier before the marker is written)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_sampler_weights: name must be a non-empty string, not {name!r}")
        start = time.perf_counter()
        copy = {n: p.detach().clone() for n, p in module.named_parameters()}
        self._snapshots[name] = copy
        if path is not None:
            target = Path(path)
            if mesh.dp_rank == 0:
                ckpt.write_shard(target, mesh, {"name": name, "params": copy})
            if dist.is_initialized():
                dist.barrier()
            if mesh.rank == 0:
                marker = target / MARKER
                tmp = marker.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(
                    json.dumps({"name": name, "tp": mesh.tp_size, "pp": mesh.pp_size}, indent=2)
                )
                os.replace(tmp, marker)
            if dist.is_initialized():
                dist.barrier()
        return {
            "name": name,
            "path": None if path is None else str(path),
            "parameters": sum(t.numel() for t in copy.values()),
            "bytes": sum(t.numel() * t.element_size() for t in copy.values()),
            "seconds": time.perf_counter() - start,
            "rank": mesh.rank,
        }

    def resolve(self, weights: str, mesh: Mesh, device: torch.device) -> dict[str, torch.Tensor]:
        """The snapshot named ``weights``, or the one written to directory ``weights``."""
        found = self._snapshots.get(weights)
        if found is not None:
            return found
        marker = Path(weights) / MARKER
        if not marker.is_file():
            raise KeyError(
                f"no sampler weights named {weights!r} (in memory: {self.names()}), and "
                f"{weights!r} is not a directory written by save_sampler_weights"
            )
        meta = json.loads(marker.read_text())
        if (meta.get("tp"), meta.get("pp")) != (mesh.tp_size, mesh.pp_size):
            raise ValueError(
                f"{weights}: sampler weights saved with tp={meta.get('tp')} pp={meta.get('pp')}; "
                f"this group has tp={mesh.tp_size} pp={mesh.pp_size}"
            )
        payload = ckpt.read_shard(weights, mesh, map_location=device)
        params: dict[str, torch.Tensor] = payload["params"]
        self._snapshots[weights] = params
        return params

    @contextlib.contextmanager
    def swapped_in(
        self, module: torch.nn.Module, params: dict[str, torch.Tensor]
    ) -> Iterator[None]:
        live = dict(module.named_parameters())
        if set(live) != set(params):
            raise ValueError("the snapshot's parameters do not match this model's")
        saved = {n: p.detach().clone() for n, p in live.items()}
        try:
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(params[n])
            yield
        finally:
            with torch.no_grad():
                for n, p in live.items():
                    p.copy_(saved[n])
