"""API keys: ``X-API-Key`` must be one of the configured keys.

Keys come from a file (one a line, ``#`` comments), a directory (a mounted Secret: each
regular file's stripped content is one key) and/or explicit keys (``TG_TINKER_API_KEY``).
Files are re-read when their listing or mtimes change (checked at most every
``recheck_s``), so a key removed from the Secret stops working once the volume updates.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Iterable
from pathlib import Path


class KeyStore:
    def __init__(
        self,
        *,
        keys: Iterable[str] = (),
        keys_file: str | None = None,
        keys_dir: str | None = None,
        recheck_s: float = 2.0,
    ) -> None:
        self._fixed = {k.strip() for k in keys if k and k.strip()}
        self._file = Path(keys_file) if keys_file else None
        self._dir = Path(keys_dir) if keys_dir else None
        self._recheck_s = recheck_s
        self._stamp: tuple[tuple[str, float, int], ...] | None = None
        self._loaded: frozenset[str] = frozenset()
        self._checked_at = 0.0
        self.refresh(force=True)

    def _sources(self) -> list[Path]:
        out: list[Path] = []
        if self._file is not None and self._file.is_file():
            out.append(self._file)
        if self._dir is not None and self._dir.is_dir():
            # Secret volumes hold ..data symlinks and dot-dirs; the keys are the plain names.
            out += sorted(
                p for p in self._dir.iterdir() if not p.name.startswith(".") and p.is_file()
            )
        return out

    def refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked_at < self._recheck_s:
            return
        self._checked_at = now
        sources = self._sources()
        stamp = tuple((str(p), p.stat().st_mtime, p.stat().st_size) for p in sources)
        if stamp == self._stamp:
            return
        keys: set[str] = set()
        for p in sources:
            text = p.read_text(encoding="utf-8", errors="replace")
            if self._file is not None and p == self._file:
                keys |= {ln.strip() for ln in text.splitlines() if ln.strip()}
                keys = {k for k in keys if not k.startswith("#")}
            else:
                if text.strip():
                    keys.add(text.strip())
        self._loaded = frozenset(keys)
        self._stamp = stamp

    def keys(self) -> frozenset[str]:
        self.refresh()
        return self._loaded | self._fixed

    def check(self, presented: str | None) -> str | None:
        """None when the key is accepted, else why not (for a 401's message)."""
        if not presented:
            return "missing X-API-Key header: set TINKER_API_KEY to a key of this group"
        ok = False
        for key in self.keys():
            ok |= hmac.compare_digest(key.encode(), presented.encode())
        if not ok:
            return "invalid API key: it is not one of this group's keys (was it removed?)"
        return None

    def empty(self) -> bool:
        return not self.keys()


def env_keys() -> list[str]:
    key = os.environ.get("TG_TINKER_API_KEY", "").strip()
    return [key] if key else []
