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
refused).

Lifecycle (issue 38): a save's ``ttl_seconds`` and ``user_metadata`` are kept beside the
checkpoint in ``<kind>/.<name>.meta.json`` (a name never starts with ``.``, so no checkpoint
has that name), the run's ``user_metadata`` in ``<model_id>/run.json``. :meth:`Paths.sweep`
deletes the checkpoints whose time is up; :meth:`Paths.delete` one checkpoint."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from tgruntime.service.auth import DEFAULT, valid_principal
from tgruntime.service.sessions import ServiceError

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
RUN_META = "run.json"  # {checkpointDir}/tinker/principals/<p>/<model_id>/run.json
MAX_TTL_S = 10 * 365 * 24 * 3600  # the SDK documents 1 hour to 10 years
PRINCIPALS = "principals"  # {checkpointDir}/tinker/principals/<principal>/
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_MODEL = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._:-]{0,127}$")
_SHAPE = (
    "expected tinker://<model_id>/weights/<name>, tinker://<model_id>/sampler_weights/<name> "
    "or tinker://<model_id>/external_weights/<name>"
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


def check_ttl(ttl: Any) -> int | None:
    """A save's ``ttl_seconds``: None (never expires) or 1 s to 10 years; else a 400."""
    if ttl is None:
        return None
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL_S:
        raise ServiceError(
            f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_S} (10 years), "
            f"or null for no expiry; got {ttl!r}"
        )
    return ttl


def check_metadata(meta: Any, what: str = "user_metadata") -> dict[str, str] | None:
    """``user_metadata``: None, or an object whose values are kept as strings."""
    if meta is None:
        return None
    if not isinstance(meta, dict) or len(json.dumps(meta, default=str)) > 64 * 1024:
        raise ServiceError(f"{what} must be a JSON object of at most 64 KiB")
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def meta_path(d: Path) -> Path:
    """The sidecar of checkpoint directory ``d``: its TTL and user_metadata."""
    return d.parent / f".{d.name}.meta.json"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Atomically (a reader sees the old or the new document)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _iso(stamp: float | None) -> str | None:
    return None if stamp is None else dt.datetime.fromtimestamp(stamp, dt.UTC).isoformat()


def disk_bytes(d: Path) -> int:
    """Bytes of the regular files under ``d`` (symlinks not followed)."""
    if d.is_symlink() or not d.is_dir():
        return 0
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())


def _remove(d: Path) -> None:
    if d.is_symlink() or d.is_file():
        d.unlink(missing_ok=True)
    elif d.is_dir():
        shutil.rmtree(d)


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
                "one (set it in the TrainerGroup spec, or pass --checkpoint-dir to the server; "
                "tgctl serve defaults to ~/.cache/trainergroup/checkpoints/<group>)"
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
                    if d.name.startswith(".") or not d.is_dir() or not _under(d, run):
                        continue  # a copy under way (.<name>.copying) is not listed yet
                    st = d.stat()
                    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                    meta = _read_json(meta_path(d))
                    out.append(
                        {
                            "checkpoint_id": f"{kind}/{d.name}",
                            "checkpoint_type": ctype,
                            "time": dt.datetime.fromtimestamp(st.st_mtime, dt.UTC).isoformat(),
                            "tinker_path": self.uri(run.name, kind, d.name),
                            "size_bytes": size,
                            "training_run_id": run.name,
                            "user_metadata": meta.get("user_metadata"),
                            "expires_at": _iso(meta.get("expires_at")),
                        }
                    )
        return out

    # -- lifecycle (issue 38) -----------------------------------------------------------
    def saved(
        self,
        d: Path,
        *,
        ttl: int | None,
        user_metadata: dict[str, str] | None,
        base_model: str,
        run_metadata: dict[str, str] | None = None,
        lora: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> None:
        """After a save into ``d``: its sidecar (replacing an earlier save's: an overwrite
        replaces the metadata and TTL), and the run's ``run.json``."""
        now = time.time() if now is None else now
        doc: dict[str, Any] = {
            "created": now,
            "ttl_seconds": ttl,
            "expires_at": None if ttl is None else now + ttl,
            "user_metadata": user_metadata,
            "base_model": base_model,
        }
        if lora is not None:
            doc["lora"] = lora
        _write_json(meta_path(d), doc)
        run = d.parent.parent
        old = _read_json(run / RUN_META)
        if run_metadata is not None or not old:
            _write_json(run / RUN_META, {**old, "user_metadata": run_metadata})

    def meta(self, d: Path) -> dict[str, Any]:
        """The sidecar of checkpoint ``d`` ({} when it has none)."""
        return _read_json(meta_path(d))

    def set_ttl(self, d: Path, ttl: int | None, now: float | None = None) -> None:
        now = time.time() if now is None else now
        doc = _read_json(meta_path(d))
        doc.update(ttl_seconds=ttl, expires_at=None if ttl is None else now + ttl)
        _write_json(meta_path(d), doc)

    def run_metadata(self, principal: str, model_id: str) -> dict[str, str] | None:
        """The ``user_metadata`` a run was created with, as its saves recorded it."""
        for run in self._run_dirs(principal):
            if run.name == model_id:
                got = _read_json(run / RUN_META).get("user_metadata")
                return got if isinstance(got, dict) else None
        return None

    def delete(self, d: Path) -> int:
        """Delete checkpoint directory ``d`` (from :meth:`parse`, so the caller's) and its
        sidecar; the bytes freed."""
        size = disk_bytes(d)
        _remove(d)
        meta_path(d).unlink(missing_ok=True)
        return size

    def sweep(self, now: float | None = None, limit: int = 256) -> list[tuple[str, int]]:
        """Delete at most ``limit`` checkpoints whose TTL has passed (any principal's), and
        sidecars left without their checkpoint; [(path on disk, bytes freed)]."""
        if self.root is None or not (self.root / PRINCIPALS).is_dir():
            return []
        now = time.time() if now is None else now
        out: list[tuple[str, int]] = []
        top = self.root / PRINCIPALS
        for side in sorted(top.glob("*/*/*/.*.meta.json")):
            if len(out) >= limit:
                break
            if side.parent.name not in KINDS or not _under(side, top):
                continue
            d = side.with_name(side.name[1 : -len(".meta.json")])
            if not d.exists() and not d.is_symlink():
                side.unlink(missing_ok=True)
                continue
            expires = _read_json(side).get("expires_at")
            if isinstance(expires, int | float) and expires <= now:
                out.append((str(d), self.delete(d)))
        return out

    def copy(self, src: Path, principal: str, model_id: str, kind: str, name: str) -> Path:
        """A full copy of checkpoint ``src`` as ``tinker://<model_id>/<kind>/<name>`` in
        ``principal``'s folder (files copied, not linked: a later overwrite of the source
        rewrites its files in place)."""
        dst = self.directory(principal, model_id, kind, name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{name}.copying")
        _remove(tmp)
        shutil.copytree(src, tmp, symlinks=False)
        os.replace(tmp, dst)
        return dst

    # -- owners and readers (issue 37: admins, sharing) -------------------------------------
    def principals(self) -> list[str]:
        """The principals with a folder (and ``default`` when saves from before principals
        exist): whose runs an admin's listing walks."""
        if self.root is None or not self.root.is_dir():
            return []
        top = self.root / PRINCIPALS
        out = (
            [p.name for p in sorted(top.iterdir()) if valid_principal(p.name) and p.is_dir()]
            if top.is_dir() and _under(top, self.root)
            else []
        )
        if DEFAULT not in out and self._run_dirs(DEFAULT):
            out.append(DEFAULT)
        return out

    def owner_of(self, model_id: str) -> str | None:
        """The principal whose folder holds run ``model_id`` (model ids are unique: 128
        random bits of a session id, or ``copy-`` and 128 random bits), else None."""
        check_model_id(model_id)
        if self.root is None or model_id == PRINCIPALS or model_id.startswith("_"):
            return None
        for principal in self.principals():
            top = self.folder(principal)
            if (top / model_id).is_dir() and _under(top / model_id, top):
                return principal
        old = self.root / model_id  # saves from before principals: the default principal's
        return DEFAULT if old.is_dir() and _under(old, self.root) else None

    def readers(self, d: Path) -> frozenset[str]:
        """The principals checkpoint ``d`` is shared with (its sidecar's ``readers``)."""
        got = _read_json(meta_path(d)).get("readers")
        if not isinstance(got, list):
            return frozenset()
        return frozenset(r for r in got if isinstance(r, str))

    def set_readers(self, d: Path, readers: frozenset[str]) -> None:
        doc = _read_json(meta_path(d))
        doc["readers"] = sorted(readers)
        _write_json(meta_path(d), doc)

    def runs(self, principal: str = DEFAULT) -> list[str]:
        return sorted({p.name for p in self._run_dirs(principal)})
