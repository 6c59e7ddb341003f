"""tools/test.sh's pytest phases split the suite: every test lands in exactly one phase.

The phases select by marker expression (UNIT, RAY, MEGATRON, PLANE, KIND in tools/test.sh).
For every combination of the project's markers (pyproject's [tool.pytest.ini_options]),
exactly one expression holds, so no test runs twice and none is left out.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASE_VARS = ("UNIT", "RAY", "MEGATRON", "PLANE", "KIND")


def _expressions() -> dict[str, str]:
    text = (REPO / "tools" / "test.sh").read_text()
    found = dict(re.findall(r'^([A-Z]+)="([^"]+)"$', text, flags=re.M))
    return {name: found[name] for name in PHASE_VARS}


def _markers() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    lines = config["tool"]["pytest"]["ini_options"]["markers"]
    return [line.split(":", 1)[0].strip() for line in lines]


def test_every_marker_combination_is_in_exactly_one_phase() -> None:
    exprs = _expressions()
    markers = _markers()
    assert {"ray", "megatron", "k8s", "docker", "kind", "e2e", "gpu"} <= set(markers)
    for bits in itertools.product((False, True), repeat=len(markers)):
        present = dict(zip(markers, bits, strict=True))
        chosen = [n for n, e in exprs.items() if eval(e, {}, present)]
        assert len(chosen) == 1, (sorted(m for m, b in present.items() if b), chosen)
