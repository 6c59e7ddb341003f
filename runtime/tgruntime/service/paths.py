"""``tinker://<model_id>/weights/<name>`` and ``.../sampler_weights/<name>`` on disk, per
principal.

They live under ``{checkpointDir}/tinker/principals/<principal>/<model_id>/<kind>/<name>``:
a ``save_state`` directory (weights) or a ``save_sampler_weights`` directory
(sampler_weights). A path names no principal: it is looked up in the caller's folder, so
another principal's path is answered like a missing one, and the owner survives a restart.
Saves from before principals (``{checkpointDir}/tinker/<model_id>/...``) are read as the
``default`` principal's.

Paths are parsed strictly: exactly three parts, each 1-128 letters, digits, ``.``, ``_``,
``-`` (and ``:`` in a model id) not starting with ``.``; no separators, no encodings. The
resolved directory must stay under the principal's folder (a symlink pointing out of it is
refused)."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

from tgruntime.service.auth import DEFAULT, valid_principal
from tgruntime.service.sessions import ServiceError

KINDS = {"weights": "training", "sampler_weights": "sampler"}
PRINCIPALS = "principals"  # {checkpointDir}/tinker/principals/<principal>/
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_MODEL = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._:-]{0,127}$")
_SHAPE = (
    "expected tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>"
)


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ServiceError(
            f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', not "
            "starting with '.'"
        )
    return name


def check_model_id(model_id: str) -> str:
    if not _MODEL.match(model_id):
        raise ServiceError(f"model id {model_id!r} is not a model id of this server")
    return model_id


def parse_uri(uri: str) -> tuple[str, str, str]:
    """(model_id, kind, name) of a well-formed ``tinker://`` path; else a 400."""
    if not isinstance(uri, str) or not uri.startswith("tinker://"):
        raise ServiceError(f"path {uri!r} is not a tinker:// path")
    parts = uri[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise ServiceError(f"path {uri!r}: {_SHAPE}")
    model_id, kind, name = parts
    if not _MODEL.match(model_id) or not _NAME.match(name):
        raise ServiceError(
            f"path {uri!r}: {_SHAPE}, each part letters, digits, '.', '_' or '-' (not starting "
            "with '.'; no separators or encoded characters)"
        )
    return model_id, kind, name


def _under(path: Path, top: Path) -> bool:
    """``path`` resolved (symlinks followed) stays inside ``top`` resolved."""
    try:
        return path.resolve().is_relative_to(top.resolve())
    except (OSError, RuntimeError):
        return False


class Paths:
    def __init__(self, root: str) -> None:
        self.root = Path(root) / "tinker" if root else None

    def _require(self) -> Path:
        if self.root is None:
            raise ServiceError(
                "the group has no training.checkpointDir: saving and loading weights needs "
                "one (set it in the TrainerGroup spec)"
            )
        return self.root

    def folder(self, principal: str) -> Path:
        """The principal's folder (not created)."""
        if not valid_principal(principal):
            raise ServiceError(f"principal {principal!r} has no valid folder name", status=500)
        return self._require() / PRINCIPALS / principal

    def run_dir(self, principal: str, model_id: str) -> Path:
        return self.folder(principal) / check_model_id(model_id)

    def directory(self, principal: str, model_id: str, kind: str, name: str) -> Path:
        """Where ``principal`` saves (refused when it would land outside its folder)."""
        top = self.folder(principal)
        d = top / check_model_id(model_id) / kind / check_name(name)
        if not _under(d, top) or not _under(top, self._require()):
            raise ServiceError(f"checkpoint {name!r}: its directory leaves the checkpoint folder")
        return d

    @staticmethod
    def uri(model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def _legacy(self, principal: str) -> Path | None:
        """Saves from before principals: the default principal's."""
        return self.root if principal == DEFAULT and self.root is not None else None

    def parse(self, uri: str, principal: str = DEFAULT) -> tuple[str, str, str, Path]:
        model_id, kind, name = parse_uri(uri)
        missing = ServiceError(f"no checkpoint at {uri}", status=404)
        top = self.folder(principal)
        d = top / model_id / kind / name
        if d.is_dir() or d.is_symlink():
            if not _under(d, top) or not _under(top, self._require()) or not d.is_dir():
                raise missing  # a symlink out of the principal's folder, or not a directory
            return model_id, kind, name, d
        old = self._legacy(principal)
        if old is not None and model_id not in (PRINCIPALS,) and not model_id.startswith("_"):
            d = old / model_id / kind / name
            if d.is_dir() and _under(d, old) and not _under(d, old / PRINCIPALS):
                return model_id, kind, name, d
        raise missing

    def _run_dirs(self, principal: str) -> list[Path]:
        if self.root is None:
            return []
        out: list[Path] = []
        top = self.folder(principal)
        if top.is_dir() and _under(top, self.root):
            out += [p for p in sorted(top.iterdir()) if p.is_dir() and _under(p, top)]
        old = self._legacy(principal)
        if old is not None and old.is_dir():
            out += [
                p
                for p in sorted(old.iterdir())
                if p.is_dir() and p.name != PRINCIPALS and not p.name.startswith("_")
                and _under(p, old)
            ]
        return out

    def listing(
        self, principal: str = DEFAULT, model_id: str | None = None
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for run in self._run_dirs(principal):
            if model_id is not None and run.name != model_id:
                continue
            for kind, ctype in KINDS.items():
                base = run / kind
                if not base.is_dir() or not _under(base, run):
                    continue
                for d in sorted(base.iterdir()):
                    if not d.is_dir() or not _under(d, run):
                        continue
                    st = d.stat()
                    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                    out.append(
                        {
                            "checkpoint_id": f"{kind}/{d.name}",
                            "checkpoint_type": ctype,
                            "time": dt.datetime.fromtimestamp(st.st_mtime, dt.UTC).isoformat(),
                            "tinker_path": self.uri(run.name, kind, d.name),
                            "size_bytes": size,
                            "training_run_id": run.name,
                        }
                    )
        return out

    def runs(self, principal: str = DEFAULT) -> list[str]:
        return sorted({p.name for p in self._run_dirs(principal)})
