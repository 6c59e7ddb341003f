"""The operator never imports Ray, torch, Megatron or the runtime (DESIGN.md)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import tg_operator

FORBIDDEN = ("ray", "torch", "megatron", "tgruntime", "tensordict")


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in FORBIDDEN)


def test_every_operator_module_imports_without_ray_torch_megatron_or_runtime() -> None:
    pkg_dir = Path(tg_operator.__file__).parent
    names = [f"tg_operator.{m.name}" for m in pkgutil.iter_modules([str(pkg_dir)])]
    assert "tg_operator.handlers" in names and "tg_operator.reconcile" in names
    code = "\n".join(f"import {n}" for n in ["tg_operator", *names])
    mods = _modules_after(code)
    assert set(names) <= mods
    assert _heavy(mods) == []


def test_client_helper_needs_neither_kopf_nor_ray() -> None:
    mods = _modules_after("import tg_operator.client_status")
    assert _heavy(mods) == []
    assert "kopf" not in mods
