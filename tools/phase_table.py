"""Print the phase table at the end of tools/test.sh and save it as JSON.

    python3 tools/phase_table.py PHASES_TSV [--stamps E2E_STAMPS] [--load-samples FILE]
                                 [--total S] [--json OUT] [--cpu-machine S] [--cpu-docker S]
                                 [--test-cpu WORK_DIR]

PHASES_TSV: ``name<TAB>seconds<TAB>cache<TAB>status<TAB>cpu`` lines written by tools/test.sh
(cache: hit, miss or - where it does not apply; cpu: CPU seconds of the phase's process tree,
or -). WORK_DIR's ``<phase>.test-cpu.tsv`` files (``nodeid<TAB>wall<TAB>cpu``, from
tests/conftest.py) give the costliest test files by CPU. E2E_STAMPS: tests/e2e/run.sh's
``stamps.env`` (``name=epoch``, in order); each stamp becomes a ``kind: <name>`` row with the
seconds since the previous one, so the kind phase's time is split by what it did. Standard
library only (it runs before and after the venv exists).
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
        name, seconds, cache, status, cpu = ([*line.split("\t"), "", "", "", "", ""])[:5]
        rows.append(
            {
                "phase": name,
                "seconds": int(seconds or 0),
                "cache": cache,
                "status": status,
                "cpu_s": int(cpu) if cpu.isdigit() else None,
            }
        )
    return rows


def file_costs(work: Path) -> list[dict[str, Any]]:
    """Test files by the CPU seconds their tests used (every process they started), with the
    wall seconds and the phase, costliest first."""
    files: dict[tuple[str, str], list[float]] = {}
    for tsv in sorted(work.glob("*.test-cpu.tsv")):
        phase = tsv.name.removesuffix(".test-cpu.tsv")
        for line in tsv.read_text().splitlines():
            nodeid, wall, cpu = ([*line.split("\t"), "", ""])[:3]
            try:
                w, c = float(wall), float(cpu)
            except ValueError:
                continue
            acc = files.setdefault((phase, nodeid.split("::")[0]), [0.0, 0.0, 0.0])
            acc[0] += w
            acc[1] += c
            acc[2] += 1
    rows = [
        {"phase": ph, "file": f, "tests": int(n), "wall_s": round(w), "cpu_s": round(c)}
        for (ph, f), (w, c, n) in files.items()
    ]
    return sorted(rows, key=lambda r: -r["cpu_s"])


def costliest_files(work: Path, top: int = 15) -> list[dict[str, Any]]:
    return file_costs(work)[:top]


def write_weights(work: Path, phases: list[dict[str, Any]], path: Path) -> None:
    """Every test file's, test's and phase's wall seconds in this run (of a --quick run: its
    phases' seconds, as ``quick_phase_s``), for tests/shard.py's split of a phase between the
    lanes (wall, not CPU: the lanes end by the clock, and the kind phase's work is in Docker's
    containers, not in its own CPU)."""
    walls: dict[str, int] = {}
    for f in file_costs(work):  # a file with tests in two phases: their sum
        walls[f["file"]] = walls.get(f["file"], 0) + f["wall_s"]
    tests: dict[str, float] = {}  # each test's own, so a phase that deselects some (--quick)
    for tsv in sorted(work.glob("*.test-cpu.tsv")):  # weighs a file by the tests it keeps
        for line in tsv.read_text().splitlines():
            nodeid, wall = ([*line.split("\t"), ""])[:2]
            try:
                tests[nodeid] = round(tests.get(nodeid, 0.0) + float(wall), 1)
            except ValueError:
                continue
    by_phase = {p["phase"]: p["seconds"] for p in phases}
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    if not {"plane", "kind"} & set(by_phase):  # a --quick run: its phases' seconds only (the
        doc = {**old, "quick_phase_s": by_phase}  # files' and tests' come from full runs)
    else:
        doc = {"wall_s": dict(sorted(walls.items())), "phase_s": by_phase,
               "test_s": dict(sorted(tests.items())), "quick_phase_s": old.get("quick_phase_s", {})}
    path.write_text(json.dumps(doc, indent=1) + "\n")


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
    ap.add_argument("--cpu-machine", type=int)
    ap.add_argument("--cpu-docker", type=int)
    ap.add_argument("--test-cpu", type=Path)
    ap.add_argument("--write-weights", type=Path, help="tests/shard-weights.json, from --test-cpu")
    args = ap.parse_args()
    rows = read_phases(args.phases)
    if args.write_weights and args.test_cpu:
        write_weights(args.test_cpu, rows, args.write_weights)
    kind_rows = read_stamps(args.stamps) if args.stamps and args.stamps.exists() else []
    out: list[dict[str, Any]] = []
    for row in rows:
        out.append(row)
        if row["phase"] == "kind":
            out.extend(kind_rows)
    load = load_summary(args.load_samples)
    width = max([len(r["phase"]) for r in out] + [12])
    print(f"\n{'phase':<{width}}  {'seconds':>7}  {'cpu s':>6}  {'cache':<5}  status")
    for r in out:
        c = "-" if r.get("cpu_s") is None else str(r["cpu_s"])
        print(f"{r['phase']:<{width}}  {r['seconds']:>7}  {c:>6}  {r['cache']:<5}  {r['status']}")
    print(f"{'total (wall)':<{width}}  {args.total:>7}")
    cpu: dict[str, Any] = {}
    if args.cpu_machine is not None:
        cpu = {"machine_s": args.cpu_machine, "docker_s": args.cpu_docker}
        if args.total:
            cpu["cores_busy"] = round(args.cpu_machine / args.total, 2)
        print(
            f"CPU seconds: the machine {args.cpu_machine} ({cpu.get('cores_busy', '-')} cores busy "
            f"on average), of which Docker's containers (kind nodes, image builds) "
            f"{args.cpu_docker}"
        )
    files = costliest_files(args.test_cpu) if args.test_cpu else []
    if files:
        fw = max(len(f["file"]) for f in files)
        print("\ncostliest test files by CPU (every process they started)")
        print(f"{'file':<{fw}}  {'phase':<12}  {'tests':>5}  {'wall s':>6}  {'cpu s':>6}")
        for f in files:
            print(
                f"{f['file']:<{fw}}  {f['phase']:<12}  {f['tests']:>5}  {f['wall_s']:>6}  "
                f"{f['cpu_s']:>6}"
            )
    if load:
        print(
            f"load average (1 min) during the run: mean {load['mean']}, max {load['max']} "
            f"({load['samples']} samples)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"phases": out, "total_s": args.total, "load": load, "cpu": cpu, "files": files},
                indent=2,
            ) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
