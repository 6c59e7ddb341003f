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

On a LoRA group, ``AdapterSnapshotStore`` keeps the active run's adapters instead (this
rank's ``A``/``B`` shards and the run's ``LoraSettings``; the base is shared and frozen, so
a snapshot is small). Its files are the same layout (``shard_tpXX_ppYYY.pt`` with
``{"format": LORA_FORMAT, "settings", "base", "run", "adapters"}``, and the marker with
``"kind": "lora"``, the settings and the base's fingerprint). A snapshot is sampled through
a sampling-only adapter set (``inject_lora`` with its settings, its tensors loaded, kept
with the snapshot) whose hooks are attached only around a ``sample`` call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.hf_weights import LlamaShape
from tgruntime.trainer.lora.inject import LoraAdapters, inject_lora
from tgruntime.trainer.lora.settings import LoraSettings

__all__ = ["LORA_FORMAT", "MARKER", "AdapterSnapshot", "AdapterSnapshotStore", "SnapshotStore"]

MARKER = "sampler_weights.json"


class SnapshotStore:
    """This rank's named parameter snapshots.

    Snapshots saved by name only stay until dropped (the service drops the superseded copies of
    ``save_weights_and_get_sampling_client``: service/sampler_weights.py). Snapshots that are
    also on disk (saved with a ``path``, e.g. ``save_weights_for_sampler(name)`` and the
    server's base weights, or read from a directory) are a cache of at most ``max_loaded``
    copies, least recently used first out: the directory stays, and a later request reads it
    again (under its name too). Before, a snapshot saved with a path stayed in memory for
    good: a loop of named saves kept one full copy of the weights per save."""

    def __init__(self, *, max_loaded: int = 2) -> None:
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: list[str] = []  # the ones also on disk, least recently used first
        self._paths: dict[str, str] = {}  # such a name -> its directory (kept once evicted)
        self.max_loaded = max_loaded

    def names(self) -> list[str]:
        return sorted(self._snapshots)

    def _room(self) -> None:
        """Evict the least recently used disk-backed copies until one more fits (room first:
        never two extra copies at once)."""
        while len(self._loaded) >= max(1, self.max_loaded):
            self._snapshots.pop(self._loaded.pop(0), None)

    def _cached(self, name: str, path: str) -> None:
        if name in self._loaded:
            self._loaded.remove(name)
        self._loaded.append(name)
        self._paths[name] = path
        while len(self._paths) > 4096:  # names only; the oldest forgotten
            del self._paths[next(iter(self._paths))]

    def save(
        self, name: str, module: torch.nn.Module, mesh: Mesh, path: str | None = None
    ) -> dict[str, Any]:
        """Collective when ``path`` is given (a barrier before the marker is written)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_sampler_weights: name must be a non-empty string, not {name!r}")
        start = time.perf_counter()
        self.drop(name)  # a name saved again: its old copy goes first
        if path is not None:
            self._room()
        copy = {n: p.detach().clone() for n, p in module.named_parameters()}
        self._snapshots[name] = copy
        if path is not None:
            self._cached(name, str(path))
            target = Path(path)
            if mesh.dp_rank == 0:
                ckpt.write_shard(target, mesh, {"name": name, "params": copy})
            ckpt.barrier()  # the checkpoint I/O group: a slow write never trips NCCL's timeout
            if mesh.rank == 0:
                marker = target / MARKER
                tmp = marker.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(
                    json.dumps({"name": name, "tp": mesh.tp_size, "pp": mesh.pp_size}, indent=2)
                )
                os.replace(tmp, marker)
            ckpt.barrier()  # the checkpoint I/O group: a slow write never trips NCCL's timeout
        return {
            "name": name,
            "path": None if path is None else str(path),
            "parameters": sum(t.numel() for t in copy.values()),
            "bytes": sum(t.numel() * t.element_size() for t in copy.values()),
            "seconds": time.perf_counter() - start,
            "rank": mesh.rank,
        }

    def drop(self, name: str) -> bool:
        if name in self._loaded:
            self._loaded.remove(name)
        self._paths.pop(name, None)
        return self._snapshots.pop(name, None) is not None

    def resident(self) -> dict[str, Any]:
        """What this rank holds: names, the disk-backed (evictable) ones among them, and the
        bytes."""
        return {
            "names": self.names(),
            "loaded": list(self._loaded),
            "bytes": sum(
                t.numel() * t.element_size() for p in self._snapshots.values() for t in p.values()
            ),
        }

    def resolve(self, weights: str, mesh: Mesh, device: torch.device) -> dict[str, torch.Tensor]:
        """The snapshot named ``weights``, or the one written to directory ``weights``."""
        found = self._snapshots.get(weights)
        if found is not None:
            if weights in self._loaded:  # most recently used last
                self._loaded.remove(weights)
                self._loaded.append(weights)
            return found
        directory = self._paths.get(weights, weights)  # an evicted name: its directory
        marker = Path(directory) / MARKER
        if not marker.is_file():
            raise KeyError(
                f"no sampler weights named {weights!r} (in memory: {self.names()}), and "
                f"{weights!r} is not a directory written by save_sampler_weights"
            )
        meta = json.loads(marker.read_text())
        if meta.get("kind") == LORA_KIND:
            raise ValueError(
                f"weights: {weights} holds LoRA adapter weights (run {meta.get('run')!r}); this "
                "group trains full weights: sample them on a LoRA group of that base model"
            )
        if (meta.get("tp"), meta.get("pp")) != (mesh.tp_size, mesh.pp_size):
            raise ValueError(
                f"{weights}: sampler weights saved with tp={meta.get('tp')} pp={meta.get('pp')}; "
                f"this group has tp={mesh.tp_size} pp={mesh.pp_size}"
            )
        self._room()
        payload = ckpt.read_shard(directory, mesh, map_location=device)
        params: dict[str, torch.Tensor] = payload["params"]
        self._snapshots[weights] = params
        self._cached(weights, directory)
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


# -- LoRA groups: snapshots of adapters -------------------------------------------------------
LORA_KIND = "lora"
LORA_FORMAT = "trainergroup.lora-sampler/1"


@dataclasses.dataclass
class AdapterSnapshot:
    """One rank's copy of a LoRA run's adapters (not the base) for sampling."""

    name: str
    settings: LoraSettings
    base: str  # the base model's fingerprint (TrainEngine.base_fingerprint)
    run: str | None  # the run it was taken from
    state: dict[str, torch.Tensor]  # LoraAdapters.state_dict() of this rank, on the device
    adapters: LoraAdapters | None = None  # the sampling-only adapter set, built on first use

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


class AdapterSnapshotStore:
    """This rank's adapter snapshots, and their sampling-only adapter sets (detached hooks)."""

    def __init__(self) -> None:
        self._snapshots: dict[str, AdapterSnapshot] = {}
        self.version = 0  # bumped on every change (callers key caches by it)

    def names(self) -> list[str]:
        return sorted(self._snapshots)

    def save(
        self,
        name: str,
        adapters: LoraAdapters,
        *,
        run: str | None,
        base: str,
        mesh: Mesh,
        path: str | None = None,
    ) -> dict[str, Any]:
        """Copy ``adapters`` (the active run's) under ``name``; with ``path``, write them
        (collective: a barrier before rank 0's marker and one after it)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_sampler_weights: name must be a non-empty string, not {name!r}")
        start = time.perf_counter()
        state = {k: v.detach().clone() for k, v in adapters.state_dict().items()}
        snap = AdapterSnapshot(
            name=name, settings=adapters.settings, base=base, run=run, state=state
        )
        if path is not None:
            target = Path(path)
            if mesh.dp_rank == 0:
                payload = {
                    "format": LORA_FORMAT,
                    "name": name,
                    "settings": snap.settings.to_dict(),
                    "base": base,
                    "run": run,
                    "adapters": {k: v.cpu() for k, v in state.items()},
                }
                ckpt.write_shard(target, mesh, payload)
            ckpt.barrier()  # the checkpoint I/O group: a slow write never trips NCCL's timeout
            if mesh.rank == 0:
                meta = {
                    "name": name,
                    "kind": LORA_KIND,
                    "tp": mesh.tp_size,
                    "pp": mesh.pp_size,
                    "lora": snap.settings.to_dict(),
                    "base": base,
                    "run": run,
                }
                marker = target / MARKER
                tmp = marker.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(meta, indent=2))
                os.replace(tmp, marker)
            ckpt.barrier()  # the checkpoint I/O group: a slow write never trips NCCL's timeout
        self._put(snap)
        return {
            "name": name,
            "path": None if path is None else str(path),
            "parameters": sum(t.numel() for t in state.values()),
            "bytes": snap.nbytes(),
            "seconds": time.perf_counter() - start,
            "rank": mesh.rank,
            "run": run,
            "lora": snap.settings.to_dict(),
        }

    def resident(self) -> dict[str, Any]:
        return {
            "names": self.names(),
            "loaded": [],
            "bytes": sum(s.nbytes() for s in self._snapshots.values()),
        }

    def _put(self, snap: AdapterSnapshot) -> None:
        old = self._snapshots.get(snap.name)
        if old is not None and old.adapters is not None:
            old.adapters.detach()
        self._snapshots[snap.name] = snap
        self.version += 1

    def drop(self, name: str) -> bool:
        snap = self._snapshots.pop(name, None)
        if snap is None:
            return False
        if snap.adapters is not None:
            snap.adapters.detach()
        self.version += 1
        return True

    def resolve(
        self, weights: str, *, mesh: Mesh, base: str, device: torch.device
    ) -> AdapterSnapshot:
        """The snapshot named ``weights``, or the one written to directory ``weights``."""
        if not isinstance(weights, str) or not weights:
            raise ValueError(
                f"weights must be a sampler-weights name or directory, not {weights!r}"
            )
        found = self._snapshots.get(weights)
        if found is not None:
            return found
        marker = Path(weights) / MARKER
        if not marker.is_file():
            raise KeyError(
                f"weights: no sampler weights named {weights!r} (in memory: {self.names()}), "
                f"and {weights!r} is not a directory written by save_sampler_weights; save the "
                "run's adapters with save_sampler_weights(name) first"
            )
        meta = json.loads(marker.read_text())
        if meta.get("kind") != LORA_KIND:
            raise ValueError(
                f"weights: {weights} holds full model weights, not LoRA adapters; this group "
                "samples adapters on its frozen base: pass adapter weights saved by a LoRA group"
            )
        if (meta.get("tp"), meta.get("pp")) != (mesh.tp_size, mesh.pp_size):
            raise ValueError(
                f"weights: {weights} was saved with tp={meta.get('tp')} pp={meta.get('pp')}; "
                f"this group has tp={mesh.tp_size} pp={mesh.pp_size}"
            )
        if meta.get("base") != base:
            raise ValueError(
                f"weights: {weights} holds an adapter trained on another base model (base "
                f"{meta.get('base')}, this group's is {base}): sample it on a group of that "
                "base model"
            )
        payload = ckpt.read_shard(weights, mesh, map_location=device)
        if payload.get("format") != LORA_FORMAT:
            raise ValueError(f"weights: {weights} is not a LoRA sampler snapshot")
        snap = AdapterSnapshot(
            name=weights,
            settings=LoraSettings.from_mapping(payload["settings"]),
            base=str(payload["base"]),
            run=payload.get("run"),
            state=dict(payload["adapters"]),
        )
        self._put(snap)
        return snap

    def adapters_for(
        self, snap: AdapterSnapshot, module: torch.nn.Module, shape: LlamaShape
    ) -> LoraAdapters:
        """The snapshot's sampling-only adapter set on ``module`` (built once, kept; its
        hooks detached: attach them around a forward)."""
        if snap.adapters is None:
            # no initial draw: the snapshot's state is loaded into them right below
            adapters = inject_lora(module, settings=snap.settings, shape=shape, initialize=False)
            adapters.detach()
            try:
                for p in adapters.parameters():
                    p.requires_grad_(False)
                with torch.no_grad():
                    adapters.load_state_dict(snap.state, strict=True)
            except RuntimeError as exc:
                raise ValueError(
                    f"weights: {snap.name!r} does not fit this model's adapters ({exc})"
                ) from None
            snap.adapters = adapters
            snap.state = {k: v.detach() for k, v in adapters.state_dict().items()}  # one copy
        return snap.adapters
