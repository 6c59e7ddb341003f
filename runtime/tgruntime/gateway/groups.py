"""The groups behind the gateway: from ``--group`` flags or a JSON file (re-read when it
changes), each a name, the group's Tinker URL, the base model names it serves (empty: asked
from the group's ``get_server_capabilities``) and, for an ``https://`` group with a private CA,
that CA's certificates (PEM: the only roots its server is verified against); in Kubernetes from
the TrainerGroups themselves (gateway.discover: ``spec.api.tls.caBundle``)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class GroupsError(ValueError):
    """A group list that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class Group:
    name: str
    url: str  # http(s)://host:port of the group's Tinker server, no trailing slash
    models: tuple[str, ...] = ()  # base model ids and aliases it serves (from the spec)
    ca: str = ""  # PEM: the roots its https:// server is verified against ("": the system's)


PEM_BEGIN = "-----BEGIN CERTIFICATE-----"


def check_ca(pem: str, where: str) -> str:
    """``pem`` (one or more PEM certificates) as an SSL context loads it, or GroupsError naming
    ``where``."""
    import ssl

    if PEM_BEGIN not in pem:
        raise GroupsError(f"{where}: not a PEM certificate (no {PEM_BEGIN!r} line)")
    try:
        ssl.create_default_context(cadata=pem)
    except (ssl.SSLError, ValueError) as exc:
        raise GroupsError(f"{where}: the CA certificates do not load: {exc}") from None
    return pem


def read_ca(path: str, where: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GroupsError(f"{where}: {path}: cannot read it ({exc})") from None
    return check_ca(text, f"{where} {path}")


def _url(url: str, where: str) -> str:
    if not re.fullmatch(r"https?://[^/\s]+/?", url):
        raise GroupsError(
            f"{where}: {url!r} is not a group's base URL: give http(s)://HOST:PORT (a "
            "TrainerGroup's status.apiURL, or what `tgctl serve` prints)"
        )
    return url.rstrip("/")


def from_flags(flags: Sequence[str], *, ca: str = "") -> tuple[Group, ...]:
    """``--group URL`` or ``--group NAME=URL`` (the name defaults to ``group-<i>``); ``ca``
    (``--ca-file``'s PEM) verifies every ``https://`` one."""
    out: list[Group] = []
    for i, flag in enumerate(flags):
        name, sep, url = flag.partition("=")
        if not sep or "://" in name:
            name, url = f"group-{i}", flag
        if not _NAME.fullmatch(name):
            raise GroupsError(f"--group {flag!r}: the name {name!r} is not a valid name")
        url = _url(url, f"--group {flag!r}")
        out.append(Group(name=name, url=url, ca=ca if url.startswith("https://") else ""))
    return _unique(out, "--group")


def from_document(doc: Any, where: str) -> tuple[Group, ...]:
    """``{"groups": [{"name", "url", "models": [...], "ca": PEM or "caFile": path}, ...]}``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        raise GroupsError(f"{where}: expected an object with a 'groups' list")
    out: list[Group] = []
    for i, g in enumerate(doc["groups"]):
        at = f"{where}: groups[{i}]"
        if not isinstance(g, dict):
            raise GroupsError(f"{at}: expected an object with name, url and models")
        name, url, models = g.get("name"), g.get("url"), g.get("models", [])
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise GroupsError(f"{at}.name: {name!r} is not a valid name")
        if not isinstance(url, str):
            raise GroupsError(f"{at}.url: a string is required, got {url!r}")
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise GroupsError(f"{at}.models: a list of model names is required, got {models!r}")
        ca, ca_file = g.get("ca"), g.get("caFile")
        if ca is not None and ca_file is not None:
            raise GroupsError(f"{at}: give ca (PEM text) or caFile (a path), not both")
        if ca is not None and not isinstance(ca, str):
            raise GroupsError(f"{at}.ca: PEM text is required, got {type(ca).__name__}")
        if ca_file is not None and not isinstance(ca_file, str):
            raise GroupsError(f"{at}.caFile: a path is required, got {ca_file!r}")
        pem = (check_ca(ca, f"{at}.ca") if ca else read_ca(ca_file, f"{at}.caFile")
               if ca_file else "")
        out.append(Group(name=name, url=_url(url, f"{at}.url"), models=tuple(models), ca=pem))
    return _unique(out, where)


def _unique(groups: list[Group], where: str) -> tuple[Group, ...]:
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GroupsError(f"{where}: group names must be unique; repeated: {dup}")
    return tuple(groups)


class Source(Protocol):
    """Where the gateway reads the current groups from (:class:`GroupSource`, or
    gateway.discover.TrainerGroupSource); ``error`` says why the list may be stale."""

    error: str | None

    def groups(self) -> tuple[Group, ...]: ...


@dataclass(kw_only=True)
class GroupSource:
    """The current groups: fixed ones, or a file re-read (checked at most every
    ``recheck_s``) when its mtime changes; a file that stops parsing keeps the last good list
    (and the error is kept for ``/healthz``)."""

    fixed: tuple[Group, ...] = ()
    path: str | None = None
    recheck_s: float = 2.0
    error: str | None = None
    _groups: tuple[Group, ...] = ()
    _stamp: float | None = None
    _checked: float = field(default=-1e9)

    def groups(self) -> tuple[Group, ...]:
        if self.path is None:
            return self.fixed
        now = time.monotonic()
        if now - self._checked >= self.recheck_s:
            self._checked = now
            self._reload()
        return self._groups

    def _reload(self) -> None:
        assert self.path is not None
        try:
            stamp = os.stat(self.path).st_mtime
        except OSError as exc:
            self.error = f"{self.path}: {exc.strerror}"
            return
        if stamp == self._stamp:
            return
        try:
            doc = json.loads(Path(self.path).read_text(encoding="utf-8"))
            self._groups = from_document(doc, self.path)
            self._stamp, self.error = stamp, None
        except (OSError, json.JSONDecodeError, GroupsError) as exc:
            self.error = str(exc)
