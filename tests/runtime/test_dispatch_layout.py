"""Mesh dispatch is written once and decorator.py / dispatch.py do not import each other."""

from __future__ import annotations

import ast
from pathlib import Path

from tgruntime.controller import decorator, dispatch

CONTROLLER = Path(dispatch.__file__).parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_dispatch_table_does_not_import_the_decorator() -> None:
    assert not {m for m in _imports(CONTROLLER / "dispatch.py") if "decorator" in m}


def test_mesh_dispatch_binds_the_tables_functions() -> None:
    mode = decorator.make_nd_compute_dataproto_dispatch_fn("actor")
    assert mode["dispatch_fn"].func is dispatch.dispatch_nd_proto  # type: ignore[attr-defined]
    assert mode["collect_fn"].func is dispatch.collect_nd_proto  # type: ignore[attr-defined]
    assert mode["dispatch_fn"].args == ("actor",)  # type: ignore[attr-defined]
    source = (CONTROLLER / "worker_group.py").read_text()
    assert "dispatch_nd_proto" not in source and "collect_nd_proto" not in source
