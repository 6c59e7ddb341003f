"""Print the phase table at the end of tools/test.sh and save it as JSON.

    python3 tools/phase_table.py PHASES_TSV [--stamps E2E_STAMPS] [--load-samples FILE]
                                 [--total S] [--json OUT]

PHASES_TSV: ``name<TAB>seconds<TAB>cache<TAB>status`` lines written by tools/test.sh (cache:
hit, miss or - where it does not apply). E2E_STAMPS: tests/e2e/run.sh's ``stamps.env``
(``name=epoch``, in order); each stamp becomes a ``kind: <name>`` row with the seconds since
the previous one, so the kind phase's time is split by what it did. Standard library only
(it runs before and after the venv exists).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def read_phases(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        name, seconds, cache, status = ([*line.split("\t"), "", "", "", ""])[:4]
        rows.append({"phase": name, "seconds": int(seconds or 0), "cache": cache, "status": status})
    return rows


def read_stamps(path: Path) -> list[dict[str, Any]]:
    """Consecutive stamps as rows: ``kind: <name>`` took the seconds since the one before."""
    rows: list[dict[str, Any]] = []
    last: float | None = None
    for line in path.read_text().splitlines():
        name, _, value = line.partition("=")
        if not value:
            continue
        t = float(value)
        if last is not None:
            rows.append(
                {"phase": f"  kind: {name}", "seconds": int(t - last), "cache": "-", "status": ""}
            )
        last = t
    return rows


def load_summary(path: Path | None) -> dict[str, float]:
    if path is None or not path.exists():
        return {}
    values = [float(x) for x in path.read_text().split() if x.strip()]
    if not values:
        return {}
    return {"mean": round(statistics.fmean(values), 2), "max": max(values), "samples": len(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phases", type=Path)
    ap.add_argument("--stamps", type=Path)
    ap.add_argument("--load-samples", type=Path)
    ap.add_argument("--total", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = read_phases(args.phases)
    kind_rows = read_stamps(args.stamps) if args.stamps and args.stamps.exists() else []
    out: list[dict[str, Any]] = []
    for row in rows:
        out.append(row)
        if row["phase"] == "kind":
            out.extend(kind_rows)
    load = load_summary(args.load_samples)
    width = max([len(r["phase"]) for r in out] + [12])
    print(f"\n{'phase':<{width}}  {'seconds':>7}  {'cache':<5}  status")
    for r in out:
        print(f"{r['phase']:<{width}}  {r['seconds']:>7}  {r['cache']:<5}  {r['status']}")
    print(f"{'total (wall)':<{width}}  {args.total:>7}")
    if load:
        print(
            f"load average (1 min) during the run: mean {load['mean']}, max {load['max']} "
            f"({load['samples']} samples)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"phases": out, "total_s": args.total, "load": load}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
