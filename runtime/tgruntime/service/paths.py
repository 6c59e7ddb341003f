"""``tinker://<model_id>/weights/<name>`` and ``.../sampler_weights/<name>`` on disk.

They live under ``{checkpointDir}/tinker/<model_id>/<kind>/<name>``: a ``save_state``
directory (weights) or a ``save_sampler_weights`` directory (sampler_weights)."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

from tgruntime.service.sessions import ServiceError

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def check_name(name: str) -> str:
    if not _NAME.match(name) or name in (".", ".."):
        raise ServiceError(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-'")
    return name


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

    def directory(self, model_id: str, kind: str, name: str) -> Path:
        return self._require() / model_id / kind / check_name(name)

    @staticmethod
    def uri(model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def parse(self, uri: str) -> tuple[str, str, str, Path]:
        if not uri.startswith("tinker://"):
            raise ServiceError(f"path {uri!r} is not a tinker:// path")
        parts = uri[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise ServiceError(
                f"path {uri!r}: expected tinker://<model_id>/weights/<name> or "
                "tinker://<model_id>/sampler_weights/<name>"
            )
        model_id, kind, name = parts
        d = self.directory(model_id, kind, name)
        if not d.is_dir():
            raise ServiceError(f"no checkpoint at {uri} (looked in {d})", status=404)
        return model_id, kind, name, d

    def listing(self, model_id: str | None = None) -> list[dict[str, Any]]:
        if self.root is None or not self.root.is_dir():
            return []
        out: list[dict[str, Any]] = []
        runs = [self.root / model_id] if model_id else sorted(self.root.iterdir())
        for run in runs:
            for kind, ctype in KINDS.items():
                base = run / kind
                if not base.is_dir():
                    continue
                for d in sorted(base.iterdir()):
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

    def runs(self) -> list[str]:
        if self.root is None or not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())
