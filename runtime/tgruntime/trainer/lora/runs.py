"""Many LoRA runs on one frozen base: each run has its own adapters, AdamW state, step
counter and pending gradient; one run is active at a time (its hooks are on the model).

A :class:`RunSet` owns the runs of one engine (one rank). Every rank of a group holds the
same runs and switches in the same order (the worker's ``use_run`` is sent to every rank),
so the collectives of a step always meet the same run's adapters. Switching is a swap of
the engine's per-run fields (:data:`RUN_FIELDS`) and of the hooks: no copy of weights.

A run can be *parked*: its adapters, their optimizer state, any pending gradient and its
counters go to one file per (tp, pp) shard and its memory is freed; the next ``use``
brings it back as it was. The service parks runs that have been idle for
``spec.api.idleRunSeconds``. ``save``/``load`` write and read the same file format as
an adapter-only checkpoint (Tinker's ``save_state``/``load_state`` of a LoRA run).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from megatron.core import parallel_state

from tgruntime.trainer.lora.inject import LoraAdapters
from tgruntime.trainer.lora.optim import bind_adapter_grads
from tgruntime.trainer.lora.settings import LoraSettings
from tgruntime.trainer.safe_load import load_state

if TYPE_CHECKING:
    from tgruntime.trainer.engine import TrainEngine

__all__ = ["DEFAULT_RUN", "RUN_FIELDS", "Run", "RunSet", "run_file"]

DEFAULT_RUN = "default"
"""The run the group's own ``spec.lora`` adapters form (what ``TrainerClient`` trains)."""

RUN_FIELDS = ("state", "adapters", "lora", "step", "_accumulated", "_reduction", "_grads_stale")
"""The engine attributes that belong to a run (swapped in by :meth:`RunSet.use`)."""

FORMAT = "trainergroup.lora-run/1"


def run_file(path: str | Path) -> Path:
    """This rank's file of a saved or parked run under directory ``path``."""
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    return Path(path) / f"run_tp{tp:02d}_pp{pp:03d}.pt"


@dataclasses.dataclass
class Run:
    run_id: str
    settings: LoraSettings
    fields: dict[str, Any] | None  # the engine's RUN_FIELDS while inactive; None when parked
    created: float = dataclasses.field(default_factory=time.time)
    last_active: float = dataclasses.field(default_factory=time.time)
    step: int = 0
    parked_at: str | None = None

    def describe(self, *, active: bool) -> dict[str, Any]:
        return {
            "id": self.run_id,
            "rank": self.settings.rank,
            "steps": self.step,
            "lastActive": self.last_active,
            "created": self.created,
            "active": active,
            "parked": self.parked_at is not None,
        }


class RunSet:
    """The LoRA runs on one engine; the engine's own adapters become run :data:`DEFAULT_RUN`."""

    def __init__(self, engine: TrainEngine) -> None:
        if engine.adapters is None or engine.lora is None:
            raise ValueError(
                "this group trains full weights: many runs need a LoRA group (set spec.lora)"
            )
        self.engine = engine
        self.runs: dict[str, Run] = {
            DEFAULT_RUN: Run(DEFAULT_RUN, engine.lora, None, step=engine.step)
        }
        self.active = DEFAULT_RUN

    # -- the active run ---------------------------------------------------------------
    def _stash(self) -> None:
        """Take the active run's fields out of the engine and its hooks off the model."""
        run = self.runs[self.active]
        e = self.engine
        run.fields = {name: getattr(e, name) for name in RUN_FIELDS}
        run.step = e.step
        if e.adapters is not None:
            e.adapters.detach()

    def _install(self, run: Run) -> None:
        assert run.fields is not None
        e = self.engine
        for name, value in run.fields.items():
            setattr(e, name, value)
        run.fields = None
        adapters: LoraAdapters = e.adapters  # type: ignore[assignment]
        adapters.attach()
        bind_adapter_grads(e.state.module.config, adapters)
        self.active = run.run_id
        run.last_active = time.time()

    def _get(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            known = ", ".join(sorted(self.runs)) or "none"
            raise ValueError(f"unknown LoRA run {run_id!r} (runs here: {known})")
        return run

    def create(self, run_id: str, settings: LoraSettings) -> dict[str, Any]:
        """A new run with fresh adapters (``settings``' rank, alpha, switches and seed); it
        becomes the active run. Collective on every rank of the group."""
        if run_id in self.runs:
            raise ValueError(f"LoRA run {run_id!r} exists already")
        self._stash()
        try:
            adapters, state = self.engine.build_adapters(settings)
        except BaseException:
            self._install(self.runs[self.active])
            raise
        fields = {
            "state": state,
            "adapters": adapters,
            "lora": settings,
            "step": 0,
            "_accumulated": 0.0,
            "_reduction": None,
            "_grads_stale": True,
        }
        adapters.detach()  # _install attaches
        run = Run(run_id, settings, fields)
        self.runs[run_id] = run
        self._install(run)
        return run.describe(active=True)

    def use(self, run_id: str) -> dict[str, Any]:
        """Make ``run_id`` the active run (bringing it back first when it is parked)."""
        run = self._get(run_id)
        if run_id != self.active:
            if run.parked_at is not None:
                self._unpark(run)
            self._stash()
            self._install(run)
        run.last_active = time.time()
        return run.describe(active=True)

    def drop(self, run_id: str) -> None:
        """Forget a run (its memory; a parked run's files stay where they are)."""
        if run_id == DEFAULT_RUN:
            raise ValueError(f"run {DEFAULT_RUN!r} is the group's own and cannot be dropped")
        self._get(run_id)
        if run_id == self.active:
            self.use(DEFAULT_RUN)
        del self.runs[run_id]

    def describe(self) -> list[dict[str, Any]]:
        if self.active in self.runs:
            self.runs[self.active].step = self.engine.step
        return [r.describe(active=r.run_id == self.active) for r in self.runs.values()]

    # -- files: save / load (adapter-only checkpoints), park / unpark --------------------
    def _payload(self) -> dict[str, Any]:
        """The active run's state, on the CPU."""
        e = self.engine
        adapters: LoraAdapters = e.adapters  # type: ignore[assignment]
        grads = {
            name: p.grad.detach().cpu().clone()
            for name, p in adapters.named_parameters()
            if p.grad is not None and not e._grads_stale
        }
        return {
            "format": FORMAT,
            "base": e.base_fingerprint(),
            "settings": e.lora.to_dict() if e.lora is not None else None,
            "layout": {"tp": e.mesh_info.tp_size, "pp": e.mesh_info.pp_size},
            "adapters": {k: v.detach().cpu().clone() for k, v in adapters.state_dict().items()},
            "optimizer": e.state.optimizer.state_dict(),
            "step": e.step,
            "accumulated": e._accumulated,
            "reduction": e._reduction,
            "grads": grads,
        }

    def save(self, path: str | Path) -> str:
        """Write the active run (adapters, AdamW state, step; no base weights) into
        directory ``path``, one file per (tp, pp) shard, from data-parallel replica 0."""
        root = Path(path)
        if parallel_state.get_data_parallel_rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            target = run_file(root)
            tmp = target.with_name(target.name + ".tmp")
            torch.save(self._payload(), tmp)
            tmp.replace(target)
        _barrier()
        return str(root)

    def _read(self, path: str | Path) -> dict[str, Any]:
        target = run_file(path)
        if not target.is_file():
            raise ValueError(
                f"{path} holds no LoRA run saved by this group's layout ({target.name} is "
                "missing): save it with save_state on a LoRA run of the same TP/PP"
            )
        payload: dict[str, Any] = load_state(target, what="a saved LoRA run")
        if payload.get("format") != FORMAT:
            raise ValueError(f"{target} is not a saved LoRA run (format {payload.get('format')!r})")
        mine = self.engine.base_fingerprint()
        if payload.get("base") != mine:
            raise ValueError(
                f"{path} holds an adapter trained on another base model (base {payload.get('base')}"
                f", this group's is {mine}): load it into a group of that base model"
            )
        return payload

    def load(self, path: str | Path, *, optimizer: bool = True) -> int:
        """Restore a saved run into the active run; its settings must be the same (rank,
        alpha, switches). ``optimizer=False``: the adapters only, AdamW starts afresh."""
        payload = self._read(path)
        e = self.engine
        saved = LoraSettings.from_mapping(payload["settings"])
        mine = e.lora
        assert mine is not None
        diff = [f for f in ("rank", "alpha", "train_attn", "train_mlp", "train_unembed")
                if getattr(saved, f) != getattr(mine, f)]
        if diff:
            raise ValueError(
                f"{path} holds an adapter with lora.{diff[0]} {getattr(saved, diff[0])!r}; this "
                f"run has {getattr(mine, diff[0])!r}: create the run with the saved settings"
            )
        self._restore(payload, optimizer=optimizer, grads=False)
        return e.step

    def _restore(self, payload: dict[str, Any], *, optimizer: bool, grads: bool) -> None:
        from tgruntime.trainer.optim import reset_optimizer_state

        e = self.engine
        adapters: LoraAdapters = e.adapters  # type: ignore[assignment]
        with torch.no_grad():
            adapters.load_state_dict(payload["adapters"], strict=True)
        if optimizer:
            e.state.optimizer.load_state_dict(payload["optimizer"])
        else:
            reset_optimizer_state(e.state.optimizer)
        e.step = int(payload["step"])
        e._accumulated, e._reduction, e._grads_stale = 0.0, None, True
        if grads and payload["grads"]:
            params = dict(adapters.named_parameters())
            for name, g in payload["grads"].items():
                params[name].grad = g.to(params[name].device)
            e._accumulated, e._reduction = payload["accumulated"], payload["reduction"]
            e._grads_stale = False
        _barrier()

    def park(self, run_id: str, path: str | Path) -> dict[str, Any]:
        """Write an inactive-or-active run's whole state (pending gradient included) to
        ``path`` and free its memory; :meth:`use` brings it back."""
        run = self._get(run_id)
        if run.parked_at is not None:
            return run.describe(active=False)
        if run_id == DEFAULT_RUN:
            raise ValueError(f"run {DEFAULT_RUN!r} is the group's own and is never parked")
        back = self.active
        self.use(run_id)
        self.save(path)
        self.use(DEFAULT_RUN if back == run_id else back)
        run.fields = None  # the adapters and AdamW state go with it
        run.parked_at = str(path)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return run.describe(active=False)

    def _unpark(self, run: Run) -> None:
        assert run.parked_at is not None
        payload = self._read(run.parked_at)
        self._stash()
        try:
            adapters, state = self.engine.build_adapters(run.settings)
        except BaseException:
            self._install(self.runs[self.active])
            raise
        adapters.detach()
        run.fields = {
            "state": state,
            "adapters": adapters,
            "lora": run.settings,
            "step": 0,
            "_accumulated": 0.0,
            "_reduction": None,
            "_grads_stale": True,
        }
        self._install(run)
        self._restore(payload, optimizer=True, grads=True)
        run.parked_at = None


def _barrier() -> None:
    # the checkpoint I/O group's long timeout: a slow save never trips the NCCL one
    from tgruntime.trainer.checkpoint import barrier

    barrier()
