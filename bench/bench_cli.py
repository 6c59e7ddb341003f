"""How fast tgctl answers on a warm local head, against a bare ``ray.init`` in the same run.

    .venv/bin/python bench/bench_cli.py [--repeat 3] [--address HOST:PORT] [--no-megatron]

Every figure is the wall time of a new OS process (interpreter start and imports
included), as a user sees it, except ``attach``, which is timed inside a driver after
``connect`` returned (what ``tgctl train`` logs as "attached ... in N ms"):

- ``connect``: ``python -c "import ray; ray.init(address=..., namespace=...)"``;
- ``status``: ``tgctl status`` of a running group;
- ``down``: ``tgctl down`` of a running group of 2 light workers
  (tests/runtime/light_workers.py:SpecEcho, created by ``tgctl up``, not timed);
- ``attach``: ``use_light_handles()`` + ``WorkerGroup.attach`` in a driver, to the tiny
  Megatron CPU group (examples/local/tiny-cpu.yaml: the class whose import the light
  handles avoid; ``--no-megatron``: the light group instead).

Targets (issue 12): status <= connect + 1 s, down <= connect + 1.5 s, attach <= 0.5 s.
Prints a table and writes docs/results/bench_cli.json. Medians over ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples/local/tiny-cpu.yaml"
RESULT = REPO / "docs/results/bench_cli.json"
TARGETS = {"status": 1.0, "down": 1.5}  # seconds beyond connect
ATTACH_TARGET_S = 0.5


def run(
    env: dict[str, str], *args: str, timeout: float = 600
) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{args} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return wall, proc


def spec(tmp: Path, *, name: str, light: bool) -> Path:
    doc = yaml.safe_load(TINY.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["workers"]["rayNamespace"] = f"bench-{name}"
    doc["spec"].setdefault("timeouts", {})["workersReadySeconds"] = 300  # fail, don't hang
    if light:
        doc["spec"]["workers"]["workerClass"] = "tests.runtime.light_workers:SpecEcho"
        doc["spec"]["workers"]["cpusPerProcess"] = 0.1
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


ATTACH_CODE = """
import json, sys, time
from tgruntime.controller.connect import connect
from tgruntime.controller.gcs_view import use_light_handles
from tgruntime.controller import WorkerGroup
t0 = time.perf_counter()
connect(address=sys.argv[1], ray_namespace=sys.argv[2])
t1 = time.perf_counter()
use_light_handles()
wg = WorkerGroup.attach(group_name=sys.argv[3], ray_namespace=sys.argv[2], timeout_s=30)
t2 = time.perf_counter()
print("BENCH " + json.dumps({"connect_s": t1 - t0, "attach_s": t2 - t1, "workers": wg.world_size,
      "megatron_imported": "megatron" in sys.modules}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--address", default=None, help="a warm head (default: start one, stop it after)"
    )
    p.add_argument("--no-megatron", action="store_true", help="attach to the light group instead")
    args = p.parse_args()

    from tgruntime.local import head as local_head

    tmp = Path(tempfile.mkdtemp(prefix="tgbench-"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(tmp / "cache"),  # never the user's remembered head
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }
    env.pop("TG_RAY_ADDRESS", None)
    head = None
    address = args.address
    if address is None:
        head = local_head.start_local_head(
            num_cpus=2, timeout_s=300, env={"RAY_AUTH_MODE": env["RAY_AUTH_MODE"]}
        )
        address = head.gcs_address
    env["RAY_ADDRESS"] = address
    tgctl = ["-m", "tgruntime.entrypoints.cli"]
    times: dict[str, list[float]] = {"connect": [], "status": [], "down": [], "attach": []}
    attach_connect: list[float] = []
    megatron_in_attach = False
    try:
        heavy = spec(tmp, name=f"tiny{uuid.uuid4().hex[:6]}", light=args.no_megatron)
        run(env, *tgctl, "up", "-f", str(heavy))  # not timed
        heavy_doc = yaml.safe_load(heavy.read_text())
        for i in range(args.repeat):
            wall, _ = run(
                env, "-c", f"import ray; ray.init(address={address!r}, namespace='bench')"
            )
            times["connect"].append(wall)
            wall, out = run(env, *tgctl, "status", "-f", str(heavy))
            assert "phase: Ready" in out.stdout, out.stdout
            times["status"].append(wall)
            _, out = run(
                env, "-c", ATTACH_CODE, address, heavy_doc["spec"]["workers"]["rayNamespace"],
                heavy_doc["metadata"]["name"],
            )
            line = next(ln for ln in out.stdout.splitlines() if ln.startswith("BENCH "))
            got = json.loads(line[6:])
            times["attach"].append(got["attach_s"])
            attach_connect.append(got["connect_s"])
            megatron_in_attach = megatron_in_attach or got["megatron_imported"]
            light = spec(tmp, name=f"light{i}{uuid.uuid4().hex[:6]}", light=True)
            run(env, *tgctl, "up", "-f", str(light))  # not timed
            wall, out = run(env, *tgctl, "down", "-f", str(light))
            assert "complete: everything checked is gone" in out.stdout, out.stdout
            times["down"].append(wall)
            print(
                f"run {i + 1}/{args.repeat}: "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                file=sys.stderr,
            )
        run(env, *tgctl, "down", "-f", str(heavy))
    finally:
        if head is not None:
            local_head.stop_local_head(head)

    med = {k: statistics.median(v) for k, v in times.items()}
    connect = med["connect"]
    rows = []
    for name in ("connect", "status", "down"):
        beyond = med[name] - connect
        target = TARGETS.get(name)
        rows.append(
            {
                "command": name,
                "median_s": round(med[name], 3),
                "runs_s": [round(x, 3) for x in times[name]],
                "vs_connect_ratio": round(med[name] / connect, 2),
                "beyond_connect_s": round(beyond, 3),
                "target_beyond_connect_s": target,
                "meets_target": None if target is None else beyond <= target,
            }
        )
    rows.append(
        {
            "command": "attach",
            "median_s": round(med["attach"], 4),
            "runs_s": [round(x, 4) for x in times["attach"]],
            "vs_connect_ratio": round(med["attach"] / connect, 3),
            "beyond_connect_s": round(med["attach"], 4),
            "target_beyond_connect_s": ATTACH_TARGET_S,
            "meets_target": med["attach"] <= ATTACH_TARGET_S,
        }
    )
    print(
        f"\n{'command':<9} {'median s':>9} {'x connect':>10} {'+ connect s':>12} {'target':>8}  ok"
    )
    for r in rows:
        goal = "" if r["target_beyond_connect_s"] is None else f"+{r['target_beyond_connect_s']:g}"
        ok = "" if r["meets_target"] is None else ("yes" if r["meets_target"] else "NO")
        print(
            f"{r['command']:<9} {r['median_s']:>9.3f} {r['vs_connect_ratio']:>10.2f} "
            f"{r['beyond_connect_s']:>12.3f} {goal:>8}  {ok}"
        )
    body: dict[str, Any] = {
        "command": "bench/bench_cli.py " + " ".join(sys.argv[1:]),
        "repeat": args.repeat,
        "warm_head": address if args.address else "started by the benchmark (2 CPUs)",
        "attach_group": "light (SpecEcho)"
        if args.no_megatron
        else "tiny Megatron CPU (examples/local/tiny-cpu.yaml)",
        "attach_imported_megatron": megatron_in_attach,
        "attach_driver_connect_median_s": round(statistics.median(attach_connect), 3),
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "rows": rows,
        "note": (
            "wall times of new processes (connect, status, down) and in-driver attach after "
            "connect"
        ),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(body, indent=2) + "\n")
    print(f"\nwrote {RESULT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
