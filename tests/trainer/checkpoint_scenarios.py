"""Per-rank bodies of test_checkpoint_resume (run in launched processes, gloo on CPU).

Each rank may get its own checkpoint root (``roots[rank]``), as ranks on nodes with their own
disks see different contents under the same ``checkpointDir``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.trainer.scenarios import _quiet, fixed_batch, tiny_spec


def _rank() -> int:
    return int(os.environ["RANK"])


def save_every_step(*, root: str, steps: int, slow_step: int, slow_s: float,
                    group_timeout_s: float) -> dict[str, Any]:
    """TP=2 on one shared root: a checkpoint after every step. The default process group's
    timeout is ``group_timeout_s``; at ``slow_step`` rank 0's shard write takes ``slow_s``
    longer than that, so the other rank waits past the default group's timeout (on the
    checkpoint I/O group, whose timeout is TG_CHECKPOINT_TIMEOUT_S)."""
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer import checkpoint as ckpt
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    spec = tiny_spec(tp=2, checkpoint_dir=root)
    init_process_group(
        resolve_settings(spec), timeout=datetime.timedelta(seconds=group_timeout_s)
    )
    write_shard = ckpt.write_shard

    def slow_write(*args: Any, **kwargs: Any) -> None:
        time.sleep(slow_s)
        write_shard(*args, **kwargs)

    try:
        engine = TrainEngine.create(spec=spec)
        saved, waited, left = [], 0.0, []
        try:
            for _ in range(steps):
                engine.train_step(fixed_batch())
                slow = engine.step == slow_step and _rank() == 0
                ckpt.write_shard = slow_write if slow else write_shard
                started = time.monotonic()
                saved.append(engine.save_checkpoint())
                if engine.step == slow_step:
                    waited = time.monotonic() - started
                left.append(sorted(p.name for p in Path(root).iterdir()))
            dist.barrier()  # the default group still works after the long wait
        finally:
            ckpt.write_shard = write_shard
            engine.shutdown()
        return {"saved": saved, "waited": waited, "left": left, "step": engine.step}
    finally:
        dist.destroy_process_group()


def per_node_resume(*, good_roots: list[str], bad_roots: list[str], out_dir: str) -> None:
    """Two TP=2 engines in one process group, each rank on its own root.

    1. ``good_roots``: rank 1's root holds a newer step than rank 0's; both must resume from
       rank 0's choice (written to ``out_dir/good{rank}.json``).
    2. ``bad_roots``: rank 1's root lacks the step rank 0 chooses; every rank must raise
       CheckpointUnreadableError (written to ``out_dir/bad{rank}.json``, then re-raised after
       a barrier, so the launch fails with it once both ranks have recorded theirs)."""
    _quiet()
    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.checkpoint import CheckpointUnreadableError
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    rank, out = _rank(), Path(out_dir)
    init_process_group(resolve_settings(tiny_spec(tp=2)))
    try:
        engine = TrainEngine.create(spec=tiny_spec(tp=2, checkpoint_dir=good_roots[rank]))
        try:
            resumed = engine.resume()
            step = engine.step
            loss = engine.train_step(fixed_batch()).loss
        finally:
            engine.shutdown()
        (out / f"good{rank}.json").write_text(
            json.dumps({"resumed": resumed, "step": step, "loss": loss})
        )
        engine = TrainEngine.create(spec=tiny_spec(tp=2, checkpoint_dir=bad_roots[rank]))
        try:
            engine.resume()
        except CheckpointUnreadableError as exc:
            (out / f"bad{rank}.json").write_text(json.dumps({
                "type": type(exc).__name__, "message": str(exc), "path": exc.path,
                "step": exc.step, "node": exc.node, "rank": exc.rank,
                "failed_ranks": exc.failed_ranks,
            }))
            dist.barrier()
            raise
        finally:
            engine.shutdown()
        (out / f"bad{rank}.json").write_text(json.dumps({"type": None, "step": engine.step}))
    finally:
        dist.destroy_process_group()


def __getattr__(name: str) -> Any:
    """``PerNodeDiskTrainer``: the built-in trainer whose ``checkpointDir`` is
    ``{checkpointDir}/node{rank}``, as if each rank's node had its own disk under the same path.

    Built on first access (Ray workers import it by name), so the launches above do not pay
    for importing the worker module."""
    if name != "PerNodeDiskTrainer":
        raise AttributeError(name)
    import dataclasses

    from tgruntime.trainer.worker import MegatronTrainer

    class PerNodeDiskTrainer(MegatronTrainer):
        def __init__(self, spec_json: str, lora_json: str | None = None) -> None:
            super().__init__(spec_json, lora_json)
            training = self.spec.training
            own = dataclasses.replace(
                training, checkpoint_dir=f"{training.checkpoint_dir}/node{self.rank}"
            )
            self.spec = dataclasses.replace(self.spec, training=own)

    PerNodeDiskTrainer.__module__ = __name__
    globals()[name] = PerNodeDiskTrainer
    return PerNodeDiskTrainer


def save_with_spec_keep(*, root: str, steps: int, keep: int) -> dict[str, Any]:
    """One rank, ``spec.training.keepCheckpoints = keep`` (TG_KEEP_CHECKPOINTS unset): a save
    into checkpointDir after every step; the step_* names and the bytes under ``root`` after
    each save."""
    _quiet()
    import dataclasses

    from tgruntime.trainer import TrainEngine
    from tgruntime.trainer.distributed import init_process_group
    from tgruntime.trainer.settings import resolve_settings

    os.environ.pop("TG_KEEP_CHECKPOINTS", None)
    base = tiny_spec(tp=1, world=1, checkpoint_dir=root)
    spec = dataclasses.replace(
        base, training=dataclasses.replace(base.training, keep_checkpoints=keep)
    )
    init_process_group(resolve_settings(spec))
    try:
        engine = TrainEngine.create(spec=spec)
        left: list[list[str]] = []
        sizes: list[int] = []
        try:
            for _ in range(steps):
                engine.train_step(fixed_batch())
                engine.save_checkpoint()
                left.append(sorted(p.name for p in Path(root).iterdir()))
                sizes.append(sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file()))
        finally:
            engine.shutdown()
        return {"left": left, "sizes": sizes}
    finally:
        dist.destroy_process_group()
