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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tgruntime.trainer import checkpoint as ckpt
from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.hf_weights import LlamaShape
from tgruntime.trainer.lora.inject import LoraAdapters, inject_lora
from tgruntime.trainer.lora.settings import LoraSettings
from tgruntime.trainer.sampling.weights_budget import (
    SamplerWeightsBudgetError,
    WeightsBudget,
    evictions_needed,
)

__all__ = [
    "LORA_FORMAT",
    "MARKER",
    "AdapterSnapshot",
    "AdapterSnapshotStore",
    "SnapshotStore",
    "param_bytes",
]

MARKER = "sampler_weights.json"


def _same(value: int) -> int:
    return value


def param_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _Budgeted:
    """The byte budget of a store's copies (weights_budget.py): which disk-backed copies go,
    least recently used first, for a new one, or the refusal, the same on every rank."""

    def __init__(self, budget: WeightsBudget | None, agree: Callable[[int], int]) -> None:
        self.budget = budget  # None: no limit
        self._agree = agree  # the largest value over the ranks (collective)
        self._loaded: list[str] = []  # the copies also on disk, least recently used first
        self._paths: dict[str, str] = {}  # such a name -> its directory (kept once evicted)

    def _sizes(self) -> dict[str, int]:  # every copy held: name -> bytes
        raise NotImplementedError

    def _evict(self, name: str) -> None:
        raise NotImplementedError

    def _make_room(self, what: str, need: int) -> None:
        """Evict until ``need`` more bytes fit (collective when there is a budget), else
        raise ``SamplerWeightsBudgetError`` on every rank, nothing changed."""
        if self.budget is None:
            return
        sizes = self._sizes()
        count = self._agree(
            evictions_needed(
                held=sum(sizes.values()),
                need=need,
                limit=self.budget.limit,
                evictable=[sizes[n] for n in self._loaded],
            )
        )
        if count > len(self._loaded):
            pinned = [(n, b) for n, b in sizes.items() if n not in self._loaded]
            raise SamplerWeightsBudgetError(
                self.budget.refusal(what=what, need=need, pinned=pinned)
            )
        for name in self._loaded[:count]:
            self._evict(name)

    def _cached(self, name: str, path: str) -> None:
        """``name`` is also on disk at ``path``: evictable, most recently used."""
        self._touch(name)
        self._paths[name] = path
        while len(self._paths) > 4096:  # names only; the oldest forgotten
            del self._paths[next(iter(self._paths))]

    def _touch(self, name: str) -> None:
        if name in self._loaded:
            self._loaded.remove(name)
        self._loaded.append(name)

    def _forget(self, name: str) -> None:
        if name in self._loaded:
            self._loaded.remove(name)
        self._paths.pop(name, None)

    def _budget_info(self) -> dict[str, Any]:
        return {
            "loaded": list(self._loaded),
            "budget_bytes": None if self.budget is None else self.budget.limit,
            "budget_source": "no limit" if self.budget is None else self.budget.source,
        }


class SnapshotStore(_Budgeted):
    """This rank's named parameter snapshots, within a byte budget (weights_budget.py).

    Snapshots saved by name only stay until dropped (the service drops the superseded copies of
    ``save_weights_and_get_sampling_client``: service/sampler_weights.py). Snapshots that are
    also on disk (saved with a ``path``, e.g. ``save_weights_for_sampler(name)`` and the
    server's base weights, or read from a directory) are a cache inside the budget, least
    recently used first out: the directory stays, and a later request reads it again (under
    its name too). ``copy_bytes``: one copy's bytes on this rank (the model's parameters)."""

    def __init__(
        self,
        *,
        copy_bytes: int,
        budget: WeightsBudget | None = None,
        agree: Callable[[int], int] = _same,
    ) -> None:
        super().__init__(budget, agree)
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self.copy_bytes = copy_bytes

    def names(self) -> list[str]:
        return sorted(self._snapshots)

    def _sizes(self) -> dict[str, int]:
        return {n: param_bytes(p) for n, p in self._snapshots.items()}

    def _evict(self, name: str) -> None:
        self._snapshots.pop(name, None)
        if name in self._loaded:
            self._loaded.remove(name)

    def save(
        self, name: str, module: torch.nn.Module, mesh: Mesh, path: str | None = None
    ) -> dict[str, Any]:
        """Collective when ``path`` is given (a barrier before the marker is written)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"save_sampler_weights: name must be a non-empty string, not {name!r}")
        start = time.perf_counter()
        self.drop(name)  # a name saved again: its old copy goes first
        self._make_room(f"weights {name!r}", self.copy_bytes)
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
        self._forget(name)
        return self._snapshots.pop(name, None) is not None

    def resident(self) -> dict[str, Any]:
        """What this rank holds: names, the disk-backed (evictable) ones among them, their
        bytes, and the budget."""
        return {
            "names": self.names(),
            "bytes": sum(self._sizes().values()),
            **self._budget_info(),
        }

    def resolve(self, weights: str, mesh: Mesh, device: torch.device) -> dict[str, torch.Tensor]:
        """The snapshot named ``weights``, or the one written to directory ``weights``."""
        found = self._snapshots.get(weights)
        if found is not None:
            if weights in self._loaded:  # most recently used last
                self._touch(weights)
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
        self._make_room(f"weights {weights!r}", self.copy_bytes)
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


class AdapterSnapshotStore(_Budgeted):
    """This rank's adapter snapshots, and their sampling-only adapter sets (detached hooks),
    within a byte budget as ``SnapshotStore``'s (the disk-backed ones a cache inside it)."""

    def __init__(
        self, *, budget: WeightsBudget | None = None, agree: Callable[[int], int] = _same
    ) -> None:
        super().__init__(budget, agree)
        self._snapshots: dict[str, AdapterSnapshot] = {}
        self.version = 0  # bumped on every change (callers key caches by it)

    def _sizes(self) -> dict[str, int]:
        return {n: s.nbytes() for n, s in self._snapshots.items()}

    def _evict(self, name: str) -> None:
        paths = self._paths.get(name)
        self.drop(name)
        if paths is not None:
            self._paths[name] = paths  # read again from there at its next use

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
        live = adapters.state_dict()
        self.drop(name)  # a name saved again: its old copy goes first
        self._make_room(f"adapters {name!r}", param_bytes(live))
        state = {k: v.detach().clone() for k, v in live.items()}
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
        if path is not None:
            self._cached(name, str(path))
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
        return {"names": self.names(), "bytes": sum(self._sizes().values()), **self._budget_info()}

    def _put(self, snap: AdapterSnapshot) -> None:
        old = self._snapshots.get(snap.name)
        if old is not None and old.adapters is not None:
            old.adapters.detach()
        self._snapshots[snap.name] = snap
        self.version += 1

    def drop(self, name: str) -> bool:
        self._forget(name)
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
            if weights in self._loaded:  # most recently used last
                self._touch(weights)
            return found
        directory = self._paths.get(weights, weights)  # an evicted name: its directory
        marker = Path(directory) / MARKER
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
        payload = ckpt.read_shard(directory, mesh, map_location=torch.device("cpu"))
        if payload.get("format") != LORA_FORMAT:
            raise ValueError(f"weights: {weights} is not a LoRA sampler snapshot")
        state: dict[str, torch.Tensor] = dict(payload["adapters"])
        self._make_room(f"adapters {weights!r}", param_bytes(state))
        snap = AdapterSnapshot(
            name=weights,
            settings=LoraSettings.from_mapping(payload["settings"]),
            base=str(payload["base"]),
            run=payload.get("run"),
            state={k: v.to(device) for k, v in state.items()},
        )
        self._put(snap)
        self._cached(weights, directory)
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
