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

Across ranks (issue 36), everything that decides or waits on checkpoint files is collective:

* **One resume point.** :func:`agree_on_resume`: rank 0 alone picks the newest complete
  checkpoint under its ``checkpointDir`` and broadcasts its step and directory name; every
  rank resolves that name under its own root, and :func:`verify_readable` has every rank
  check that it can read ``meta.json`` (same step) and its own shard. One rank that cannot
  makes every rank raise :class:`CheckpointUnreadableError` naming that rank's path, step and
  node, instead of ranks resuming from different steps (per-node disks) and diverging.
* **Waits that outlast slow storage.** The barriers around checkpoint I/O (:func:`barrier`,
  the resume broadcast and check) run on a gloo group of their own (:func:`init_io_group`)
  whose timeout is ``TG_CHECKPOINT_TIMEOUT_S`` seconds (default 7200), not the training
  group's 10-minute NCCL timeout: ranks that do not write wait there while the shard writers
  finish, however long a large save on NFS-class storage takes.
* **Housekeeping.** :func:`clean_stray_temps` removes the temporary files an interrupted
  save left (each rank only the names it writes itself); :func:`prune` keeps the newest
  ``keep`` complete checkpoints after a save (``spec.training.keepCheckpoints`` or
  ``TG_KEEP_CHECKPOINTS``; :func:`keep_checkpoints`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from tgapi.errors import PicklableError
from tgruntime.trainer.distributed import Mesh
from tgruntime.trainer.safe_load import load_state

__all__ = [
    "CHECKPOINT_FORMAT",
    "DEFAULT_IO_TIMEOUT_S",
    "ENV_IO_TIMEOUT",
    "ENV_KEEP",
    "CheckpointUnreadableError",
    "agree_on_resume",
    "barrier",
    "capture_rng",
    "clean_stray_temps",
    "destroy_io_group",
    "init_io_group",
    "io_group",
    "io_timeout",
    "is_step_dir",
    "keep_checkpoints",
    "latest_checkpoint",
    "prune",
    "read_meta",
    "read_shard",
    "read_shard_agreed",
    "restore_rng",
    "shard_path",
    "step_dirname",
    "verify_readable",
    "write_meta",
    "write_shard",
]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
META = "meta.json"
ENV_IO_TIMEOUT = "TG_CHECKPOINT_TIMEOUT_S"
DEFAULT_IO_TIMEOUT_S = 7200  # two hours: an 8 B full-weight save on NFS-class storage fits
ENV_KEEP = "TG_KEEP_CHECKPOINTS"
_STEP_DIR = re.compile(r"step_(\d{8})")
_SHARD_TMP = re.compile(r"(shard_tp(\d+)_pp(\d+))\.tmp\d+")
_META_TMP = re.compile(r"meta\.tmp\d+")


class CheckpointUnreadableError(PicklableError, RuntimeError):
    """A rank cannot read the checkpoint the group resumes from (or loads).

    ``path``: that rank's checkpoint directory; ``step``: the step rank 0 chose (None when
    unknown); ``node``: the host the rank runs on; ``rank``: the first rank that failed;
    ``reason``: what it found; ``failed_ranks``: every rank that failed; ``fix``: what to do
    (default: about storage every rank sees). Every rank of the group raises the same error,
    so the group fails instead of its replicas diverging (or waiting on a failed rank).
    """

    def __init__(
        self,
        *,
        path: str,
        step: int | None,
        node: str,
        rank: int,
        reason: str,
        failed_ranks: list[int],
        fix: str | None = None,
    ) -> None:
        self.path = path
        self.step = step
        self.node = node
        self.rank = rank
        self.reason = reason
        self.failed_ranks = list(failed_ranks)
        which = f"step {step}" if step is not None else "the checkpoint"
        others = [r for r in self.failed_ranks if r != rank]
        also = f" (ranks {others} failed too)" if others else ""
        fix = fix or (
            "Rank 0 chose this checkpoint for every rank, and a rank that resumed from another "
            "step would silently diverge. Fix: put training.checkpointDir on storage every "
            "worker mounts (rayCluster.storage, ReadWriteMany), or remove the checkpoint from "
            "rank 0's directory so an older one is chosen"
        )
        super().__init__(
            f"rank {rank} on node {node} cannot read {which} at {path}: {reason}{also}. {fix}"
        )


# -- the process group of checkpoint I/O --------------------------------------------------
_io_group: Any = None  # a gloo ProcessGroup with io_timeout(), or None (use the default)


def io_timeout() -> datetime.timedelta:
    """How long a collective wait around checkpoint I/O may last (``TG_CHECKPOINT_TIMEOUT_S``
    seconds, default :data:`DEFAULT_IO_TIMEOUT_S`)."""
    raw = os.environ.get(ENV_IO_TIMEOUT, "").strip()
    if not raw:
        return datetime.timedelta(seconds=DEFAULT_IO_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{ENV_IO_TIMEOUT} must be a positive number of seconds, not {raw!r}")
    return datetime.timedelta(seconds=seconds)


def init_io_group() -> None:
    """Collective (every rank, same order as other groups): the gloo group of checkpoint I/O
    waits, with :func:`io_timeout`. Without torch.distributed, nothing."""
    global _io_group
    if not dist.is_initialized():
        return
    timeout = io_timeout()
    destroy_io_group()
    _io_group = dist.new_group(backend="gloo", timeout=timeout)


def destroy_io_group() -> None:
    global _io_group
    group, _io_group = _io_group, None
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def io_group() -> Any:
    """The checkpoint I/O group for other collectives around file I/O (None: the default)."""
    return _io_group


def barrier() -> None:
    """Wait for every rank, on the checkpoint I/O group (long timeout) when there is one."""
    if dist.is_initialized():
        dist.barrier(group=_io_group)


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
    """This rank's shard, loaded with the restricted unpickler (:mod:`.safe_load`): a crafted
    file raises ``pickle.UnpicklingError`` naming it, without running anything."""
    payload: dict[str, Any] = load_state(
        shard_path(path, mesh), what="a checkpoint shard", map_location=map_location
    )
    return payload


def read_shard_agreed(
    path: str | Path, mesh: Mesh, *, map_location: torch.device, step: int | None = None
) -> dict[str, Any]:
    """Collective :func:`read_shard`: a rank whose shard cannot be loaded (refused as unsafe,
    truncated, unreadable) makes every rank raise :class:`CheckpointUnreadableError` naming it,
    instead of failing alone while the others wait on the next barrier."""
    problem: str | None = None
    payload: dict[str, Any] = {}
    try:
        payload = read_shard(path, mesh, map_location=map_location)
    except (pickle.UnpicklingError, OSError, RuntimeError, EOFError, ValueError) as exc:
        problem = str(exc)
    mine: dict[str, Any] = {"rank": _rank(), "node": _node(), "path": str(path), "problem": problem}
    views: list[Any] = [mine]
    if dist.is_initialized():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine, group=_io_group)
    failed = [v for v in views if v["problem"] is not None]
    if failed:
        first = failed[0]
        raise CheckpointUnreadableError(
            path=str(first["path"]),
            step=step,
            node=str(first["node"]),
            rank=int(first["rank"]),
            reason=f"its shard cannot be loaded: {first['problem']}",
            failed_ranks=[int(v["rank"]) for v in failed],
            fix="Every rank stops rather than resume without it. Fix: remove the checkpoint "
            "(an older one is then chosen), or load one written by a TrainerGroup",
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


def _node() -> str:
    return socket.gethostname()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _step_of(path: Path) -> int:
    return int(json.loads((path / META).read_text()).get("step", -1))


def agree_on_resume(root: str | Path) -> tuple[Path, int] | None:
    """Collective: the checkpoint every rank resumes from, chosen by rank 0, and its step.

    Rank 0 picks :func:`latest_checkpoint` of its ``root`` and broadcasts the step and the
    directory's name; each rank returns that name under its own ``root`` (None on every rank
    when rank 0 has none: the whole group starts fresh). The caller then checks it with
    :func:`verify_readable` (``TrainEngine.load_checkpoint`` does, with the step).
    """
    root = Path(root)
    choice: list[Any] = [None]
    if _rank() == 0:
        found = latest_checkpoint(root)
        if found is not None:
            choice[0] = {"step": _step_of(found), "name": "" if found == root else found.name}
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0, group=_io_group)
    if choice[0] is None:
        return None
    name, step = str(choice[0]["name"]), int(choice[0]["step"])
    return (root / name if name else root), step


def _local_problem(path: Path, shard: Path | None, step: int | None) -> tuple[str | None, int]:
    """(what keeps this rank from reading the checkpoint or None, the step its meta says)."""
    meta_file = path / META
    if not meta_file.is_file():
        what = "the directory does not exist" if not path.exists() else f"it has no {META}"
        return f"{what} (missing or incomplete on this node)", -1
    try:
        meta = json.loads(meta_file.read_text())
        seen = int(meta.get("step", -1))
    except (OSError, ValueError) as exc:
        return f"{meta_file} is unreadable: {exc}", -1
    if meta.get("format") != CHECKPOINT_FORMAT:
        return f"checkpoint format {meta.get('format')} is not {CHECKPOINT_FORMAT}", seen
    if step is not None and seen != step:
        return f"its {META} is of step {seen}, not {step}", seen
    if shard is not None:
        if not shard.is_file():
            return f"this rank's shard {shard.name} is missing", seen
        try:
            with shard.open("rb") as f:
                f.read(1)
        except OSError as exc:
            return f"this rank's shard {shard.name} is unreadable: {exc}", seen
    return None, seen


def verify_readable(path: str | Path, *, step: int | None = None, mesh: Mesh | None = None) -> int:
    """Collective: every rank checks that it can read the checkpoint at ``path`` (its
    ``meta.json`` of ``step``, or of rank 0's step when None, and its own shard when ``mesh``
    is given); returns the step. Any rank that cannot makes every rank raise
    :class:`CheckpointUnreadableError` naming the first such rank's path, step and node."""
    path = Path(path)
    shard = shard_path(path, mesh) if mesh is not None else None
    problem, seen = _local_problem(path, shard, step)
    mine: dict[str, Any] = {
        "rank": _rank(), "node": _node(), "path": str(path), "problem": problem, "step": seen
    }
    views: list[Any] = [mine]
    if dist.is_initialized():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine, group=_io_group)
    expected = step if step is not None else int(views[0]["step"])
    failed: list[dict[str, Any]] = []
    for view in views:
        if view["problem"] is None and expected >= 0 and view["step"] != expected:
            view["problem"] = f"its {META} is of step {view['step']}, rank 0's of {expected}"
        if view["problem"] is not None:
            failed.append(view)
    if failed:
        first = failed[0]
        raise CheckpointUnreadableError(
            path=str(first["path"]),
            step=expected if expected >= 0 else None,
            node=str(first["node"]),
            rank=int(first["rank"]),
            reason=str(first["problem"]),
            failed_ranks=[int(v["rank"]) for v in failed],
        )
    return expected


# -- housekeeping -----------------------------------------------------------------------
def is_step_dir(path: str | Path) -> bool:
    """Whether ``path`` is named as the engine names checkpoints (``step_00000012``)."""
    return _STEP_DIR.fullmatch(Path(path).name) is not None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        match = _STEP_DIR.fullmatch(child.name)
        if match and child.is_dir():
            out.append((int(match.group(1)), child))
    return sorted(out)


def clean_stray_temps(root: str | Path, mesh: Mesh) -> list[Path]:
    """Remove the temporary files interrupted saves left under ``root`` (in it and in its
    ``step_*`` directories). Each rank removes only the names it writes itself (its shard's
    when it is a shard writer, ``meta.json``'s on rank 0), so ranks never race. Returns them."""
    root = Path(root)
    writer = mesh.dp_rank == 0 and mesh.cp_rank == 0
    removed: list[Path] = []
    for folder in [root, *(p for _, p in _step_dirs(root))]:
        if not folder.is_dir():
            continue
        for child in folder.iterdir():
            shard = _SHARD_TMP.fullmatch(child.name)
            mine = (
                writer and shard is not None
                and (int(shard.group(2)), int(shard.group(3))) == (mesh.tp_rank, mesh.pp_rank)
            ) or (mesh.rank == 0 and _META_TMP.fullmatch(child.name) is not None)
            if mine and child.is_file():
                try:
                    child.unlink()
                except FileNotFoundError:
                    continue
                removed.append(child)
    if removed:
        log.warning("removed %d temporary file(s) of interrupted saves: %s", len(removed),
                    ", ".join(str(p) for p in removed[:5]))
    return removed


def keep_checkpoints(spec: Any) -> int:
    """How many complete checkpoints a save keeps under ``training.checkpointDir`` (0: all).

    ``spec.training.keepCheckpoints`` when the spec has it and it is positive, else the
    ``TG_KEEP_CHECKPOINTS`` environment variable, else 0."""
    value = getattr(getattr(spec, "training", None), "keep_checkpoints", None)
    if isinstance(value, int) and value > 0:
        return value
    raw = os.environ.get(ENV_KEEP, "").strip()
    if not raw:
        return 0
    try:
        keep = int(raw)
    except ValueError:
        keep = -1
    if keep < 0:
        raise ValueError(f"{ENV_KEEP} must be a whole number >= 0, not {raw!r}")
    return keep


def prune(root: str | Path, keep: int, *, saved: str | Path) -> list[Path]:
    """Keep the newest ``keep`` complete ``step_*`` checkpoints under ``root`` (the one just
    ``saved`` always among them) and remove the older ones, and incomplete ``step_*``
    directories (interrupted saves) of a lower step than ``saved``. ``meta.json`` goes first,
    so a removal cut short leaves an incomplete directory, never a damaged complete one.
    Other names under ``root`` are never touched. Returns what was removed."""
    if keep <= 0:
        return []
    root, saved = Path(root), Path(saved)
    dirs = _step_dirs(root)
    complete = [(s, p) for s, p in dirs if (p / META).is_file()]
    kept = {p for _, p in complete[-keep:]} | {saved}
    saved_step = next((s for s, p in dirs if p == saved), None)
    doomed = [p for _, p in complete if p not in kept]
    if saved_step is not None:
        doomed += [p for s, p in dirs if s < saved_step and not (p / META).is_file()]
    for path in doomed:
        (path / META).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        log.info("keepCheckpoints %d: removed %s", keep, ", ".join(p.name for p in doomed))
    return doomed
