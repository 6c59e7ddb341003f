"""docs/operator.md keeps up with the code: every module of tg_operator has a row in the
module table, and every rule name the operator decides with is in a decision table.

Issue 21 found the module table missing five modules and the decision table missing
``io-failed``; these checks fail when a new module or rule lands without its row.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "operator" / "tg_operator"
DOC = REPO / "docs" / "operator.md"


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _module_table_names() -> set[str]:
    """The modules named in the first cell of each row of the '## Modules' table."""
    names: set[str] = set()
    for line in _section(DOC.read_text(), "## Modules").splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)\.py`", first_cell))
    return names


def _rule_names() -> set[str]:
    """Every literal rule name (``rule="..."``) in the operator's sources."""
    found: set[str] = set()
    for path in PACKAGE.glob("*.py"):
        found.update(re.findall(r'\brule="([a-z][a-z-]*)"', path.read_text()))
    return found


def test_every_module_has_a_row_in_the_module_table() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    missing = sorted(modules - _module_table_names())
    assert not missing, f"docs/operator.md '## Modules' has no row for: {missing}"


def test_the_module_table_names_no_module_that_is_gone() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    stale = sorted(_module_table_names() - modules)
    assert not stale, f"docs/operator.md '## Modules' names modules that do not exist: {stale}"


def test_every_rule_is_in_a_table_of_the_doc() -> None:
    rules = _rule_names()
    assert {"io-failed", "clean-ray", "watch", "ray-unreachable"} <= rules  # the scan works
    rows = "\n".join(line for line in DOC.read_text().splitlines() if line.startswith("| "))
    missing = sorted(r for r in rules if f"`{r}`" not in rows)
    assert not missing, f"docs/operator.md has no table row naming the rules: {missing}"
