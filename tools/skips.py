#!/usr/bin/env python3
"""Skipped tests by reason, checked against an allow-list.

``tools/skips.py WORK ALLOW``: reads ``WORK/*.skips.tsv`` (``nodeid<TAB>reason`` lines that
tests/conftest.py writes for every skipped test), prints how many tests each reason skipped,
and exits 1 when a reason matches none of ALLOW's regular expressions (one per line, ``#``
comments). A skip that is not on the list is a broken install or a missing tool, not a test
that cannot run here: CI fails on it (docs/testing.md, "Skips").
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path


def read_skips(work: Path) -> Counter[str]:
    reasons: Counter[str] = Counter()
    for tsv in sorted(work.glob("*.skips.tsv")):
        for line in tsv.read_text(encoding="utf-8").splitlines():
            _, _, reason = line.partition("\t")
            reasons[reason.strip() or "(no reason given)"] += 1
    return reasons


def read_allow(path: Path) -> list[re.Pattern[str]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(re.compile(line))
    return out


def unexpected(reasons: Counter[str], allow: list[re.Pattern[str]]) -> list[str]:
    return [r for r in reasons if not any(p.search(r) for p in allow)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: tools/skips.py WORK_DIR ALLOW_FILE", file=sys.stderr)
        return 2
    work, allow_file = Path(argv[0]), Path(argv[1])
    reasons = read_skips(work)
    bad = unexpected(reasons, read_allow(allow_file))
    total = sum(reasons.values())
    print(f"\nskipped tests: {total}" + (" (by reason)" if total else ""))
    for reason, n in reasons.most_common():
        mark = "NOT ALLOWED  " if reason in bad else ""
        print(f"{n:>5}  {mark}{reason[:160]}")
    if bad:
        print(
            f"skips: {len(bad)} reason(s) are not in {allow_file}: a missing tool or a broken "
            "install, not a test that cannot run here. Fix the install, or add the reason "
            "there with why it cannot run on this machine."
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
