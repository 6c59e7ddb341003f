"""API keys: ``X-API-Key`` must be one of the configured keys; each key belongs to a principal.

A principal is a name (``team-a``); everything it creates is its own (service.policy). Keys
come from
- a file (``--keys-file``): ``name key`` lines, ``#`` comments; a line with a key alone
  belongs to the ``default`` principal;
- a directory (``--keys-dir``, a mounted Secret): each regular file is one key, its name
  the principal (the operator's generated key is the Secret entry ``default``);
- explicit keys (``TG_TINKER_API_KEY``): the ``default`` principal.
Files are re-read when their listing or mtimes change (checked at most every ``recheck_s``),
so a key removed from the Secret stops working once the volume updates. A key given to two
principals is refused (which one it means is ambiguous), and so are lines and files whose
principal name is not valid (1-64 letters, digits, ``.``, ``_``, ``-``, not starting with
``.``, ``_`` or ``-``: the name is a folder of the checkpoint directory).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tgruntime.service")

DEFAULT = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def valid_principal(name: str) -> bool:
    return bool(_NAME.match(name))


class KeyStore:
    def __init__(
        self,
        *,
        keys: Iterable[str] = (),
        keys_file: str | None = None,
        keys_dir: str | None = None,
        recheck_s: float = 2.0,
    ) -> None:
        self._fixed = [(k.strip(), DEFAULT) for k in keys if k and k.strip()]
        self._file = Path(keys_file) if keys_file else None
        self._dir = Path(keys_dir) if keys_dir else None
        self._recheck_s = recheck_s
        self._stamp: tuple[tuple[str, float, int], ...] | None = None
        self._loaded: tuple[tuple[str, str], ...] = ()
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

    def _file_entries(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for n, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) == 1:
                out.append((words[0], DEFAULT))
            elif len(words) == 2 and valid_principal(words[0]):
                out.append((words[1], words[0]))
            else:
                log.warning("keys file line %d is neither 'KEY' nor 'NAME KEY': ignored", n)
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
        entries: list[tuple[str, str]] = []
        for p in sources:
            text = p.read_text(encoding="utf-8", errors="replace")
            if self._file is not None and p == self._file:
                entries += self._file_entries(text)
            elif not valid_principal(p.name):
                log.warning("keys directory entry %r: not a principal name, ignored", p.name)
            elif text.strip():
                entries.append((text.strip(), p.name))
        self._loaded = tuple(entries)
        self._stamp = stamp

    def entries(self) -> list[tuple[str, str]]:
        """(key, principal) pairs; a key of two principals is left out."""
        self.refresh()
        owners: dict[str, set[str]] = {}
        for key, who in [*self._loaded, *self._fixed]:
            owners.setdefault(key, set()).add(who)
        return [(k, next(iter(w))) for k, w in owners.items() if len(w) == 1]

    def keys(self) -> frozenset[str]:
        return frozenset(k for k, _ in self.entries())

    def principals(self) -> frozenset[str]:
        return frozenset(p for _, p in self.entries())

    def resolve(self, presented: str | None) -> tuple[str | None, str | None]:
        """(the key's principal, None) when accepted, else (None, why not: a 401's message).
        Every key is compared in constant time, whichever matches."""
        if not presented:
            return None, "missing X-API-Key header: set TINKER_API_KEY to a key of this group"
        found: str | None = None
        for key, who in self.entries():
            if hmac.compare_digest(key.encode(), presented.encode()):
                found = who
        if found is None:
            return None, "invalid API key: it is not one of this group's keys (was it removed?)"
        return found, None

    def check(self, presented: str | None) -> str | None:
        """None when the key is accepted, else why not (for a 401's message)."""
        return self.resolve(presented)[1]

    def empty(self) -> bool:
        return not self.entries()


def env_keys() -> list[str]:
    key = os.environ.get("TG_TINKER_API_KEY", "").strip()
    return [key] if key else []
