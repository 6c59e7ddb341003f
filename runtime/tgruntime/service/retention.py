"""``spec.training.keepCheckpoints`` for the Tinker API's named checkpoints (issue 38).

After each named save of a run (``save_state``, ``save_weights_for_sampler`` with a name), the
server keeps that run's newest ``keep`` checkpoints of that kind (``weights`` and
``sampler_weights`` are counted apart: a cookbook run saves both every N steps, and a resume
needs a state as much as a sampler needs weights) and deletes the older ones with their
sidecars, as a DELETE would. Newest is by the save's time in its sidecar (``created``; the
folder's mtime when it has none). The checkpoint just saved is always kept; 0 keeps all.
Other runs, other principals and copies (``copy_weights`` makes a run of its own) are never
touched."""

from __future__ import annotations

from pathlib import Path

from tgruntime.service.paths import Paths, meta_path


def _saved_at(paths: Paths, d: Path) -> float:
    created = paths.meta(d).get("created")
    if isinstance(created, int | float):
        return float(created)
    try:
        return d.stat().st_mtime
    except OSError:
        return 0.0


def doomed(paths: Paths, saved: Path, keep: int) -> list[Path]:
    """The checkpoints of ``saved``'s run and kind beyond the newest ``keep`` (``saved``
    never among them), oldest first."""
    if keep <= 0:
        return []
    kind_dir = saved.parent
    others = [
        d
        for d in kind_dir.iterdir()
        if not d.name.startswith(".") and d.is_dir() and not d.is_symlink()
    ]
    others.sort(key=lambda d: (_saved_at(paths, d), d.name))
    newest = others[-keep:]
    if saved not in newest:  # a save stamped older than others (a clock step): kept anyway
        newest = [*others[-(keep - 1) :], saved] if keep > 1 else [saved]
    return [d for d in others if d not in newest and d != saved]


def prune(paths: Paths, saved: Path, keep: int) -> list[tuple[Path, int]]:
    """Delete :func:`doomed`'s checkpoints (directory and sidecar); [(directory, bytes)]."""
    out: list[tuple[Path, int]] = []
    for d in doomed(paths, saved, keep):
        if d.exists() or meta_path(d).exists():
            out.append((d, paths.delete(d)))
    return out
