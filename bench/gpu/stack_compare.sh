#!/usr/bin/env bash
# Runs on the lent GPU machine: issue 36's old-vs-new stack figures in one session. The seed
# shape's step through the group and directly (bench/bench_group_step.py), once on the carried
# stack (megatron-core 0.19.2) and once with megatron-core 0.16.1 put first on the path (the
# stack before the move), alternating NEW OLD NEW, so the card's drift shows.
# Carry .whl/carry after `tools/device-carry.sh` and `tools/device-carry.sh mcore016`.
#   STEPS=10 WARMUP=3 bash bench/gpu/stack_compare.sh [CASE]     (CASE default seed:tp1)
# RUNS="new1 old" runs those only (default "new1 old new2").
# Writes $OUT/stack_{new1,old,new2}/gpu_step.json and $OUT/stack_compare.json, prints a table.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
CASE="${1:-seed:tp1}"
OLD=/tmp/mcore016
if [ ! -d "$OLD/megatron" ]; then
  mkdir -p "$OLD" && tar -C "$OLD" -xJf .whl/carry/mcore016-py312.tar.xz || { echo "unpack of mcore016 failed"; exit 2; }
fi
rc=0
for run in ${RUNS:-new1 old new2}; do
  first=""; [ "$run" = old ] && first="$OLD"
  echo "== $run (${first:+megatron-core 0.16.1 first}${first:-carried megatron-core})"
  OUT="$OUT/stack_$run" TG_SITE_FIRST="$first" bash bench/gpu/run_on_device.sh "$CASE" || rc=1
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
for run in ("new1", "old", "new2"):
    path = out / f"stack_{run}" / "gpu_step.json"
    if not path.exists():
        print(f"{run}: no result ({path})")
        continue
    by_path = {r["path"]: r for r in json.loads(path.read_text())["rows"]}
    d, g = by_path.get("direct"), by_path.get("group")
    if d is None or g is None:
        print(f"{run}: missing direct or group row")
        continue
    rows.append({
        "run": run, "megatron_core": d.get("megatron_core", "?"),
        "direct_ms": 1e3 * d["step_s"]["median"], "group_ms": 1e3 * g["step_s"]["median"],
        "ratio": d["step_s"]["median"] / g["step_s"]["median"], "mfu_direct": d.get("mfu"),
        "mfu_group": g.get("mfu"), "gpu": d.get("gpu_name"),
    })
print(f"{'run':<6} {'megatron-core':<16} {'direct ms':>10} {'group ms':>10} {'direct/group':>13} {'MFU direct':>11} {'MFU group':>10}")
for r in rows:
    print(f"{r['run']:<6} {r['megatron_core']:<16} {r['direct_ms']:>10.1f} {r['group_ms']:>10.1f} {r['ratio']:>13.3f} "
          f"{r['mfu_direct'] or 0:>11.3f} {r['mfu_group'] or 0:>10.3f}")
(out / "stack_compare.json").write_text(json.dumps({"rows": rows}, indent=1))
PY
exit $rc
