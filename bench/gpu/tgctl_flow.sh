#!/usr/bin/env bash
# The embedded default on the lent GPU machine, as a new user runs it (docs/gpu.md):
# no flags, no Ray running: `tgctl up -f SPEC`, `tgctl status`, `tgctl train --steps N`,
# `tgctl down`, each timed; then one group the head can never hold (must fail at once).
#   bash bench/gpu/tgctl_flow.sh [SPEC] [STEPS]     (carry: .whl/carry, from tools/device-carry.sh)
# Writes $OUT/flow.log (everything) and $OUT/flow.json (timings, ready line, step times).
set -uo pipefail
SPEC="${1:-examples/local/seed-gpu-tp1.yaml}"
STEPS="${2:-5}"
T0=$(date +%s.%N)
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
LOG="$OUT/flow.log"; : > "$LOG"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
SRC="${TG_SRC:-$PWD}"  # a `git archive` export, carried, when the tree holds others' edits
export PYTHONPATH="$SITE:$SRC/api:$SRC/runtime"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 XDG_CACHE_HOME=/tmp/tgcache
unset RAY_ADDRESS TG_RAY_ADDRESS
PYDIR="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
if [ ! -x "$PYDIR/ray" ]; then  # the carried ray has no console script
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' "$PYDIR/python3" > "$PYDIR/ray"
  chmod +x "$PYDIR/ray"
fi
echo "unpacked in $(python3 -c "print(round($(date +%s.%N) - $T0, 1))")s" | tee -a "$LOG"
{ nvidia-smi -L; ls /proc/driver/nvidia/gpus 2>&1; echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"; } 2>&1 | tee -a "$LOG"
python3 -c "from tgruntime.local.cluster import detect_gpus; print('detect_gpus:', detect_gpus())" 2>&1 | tee -a "$LOG"

tgctl() { python3 -m tgruntime.entrypoints.cli "$@"; }
declare -A SECS RC
step() {  # step NAME CMD...: run, log, time
  local name=$1; shift
  local t=$(date +%s.%N)
  echo "=== $name: $*" >> "$LOG"
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  RC[$name]=$?
  SECS[$name]=$(python3 -c "print(round($(date +%s.%N) - $t, 2))")
  cat "$OUT/$name.out" >> "$LOG"
  grep -v -i -E "warn|megatron_fsdp|apex|^\s*$" "$OUT/$name.err" | tail -25 >> "$LOG"
  echo "--- $name: rc=${RC[$name]} in ${SECS[$name]}s" | tee -a "$LOG"
  grep -E "^(group|  device|  rank|phase|device|RANK|[0-9])" "$OUT/$name.out" | head -8
}
step up tgctl up -f "$SPEC"
if [ "${RC[up]}" != 0 ]; then
  tail -40 "$OUT/up.err"
  echo "up failed; retrying with the dashboard off" | tee -a "$LOG"
  tgctl down -f "$SPEC" --stop-ray >> "$LOG" 2>&1
  export TG_RAY_INCLUDE_DASHBOARD=0
  step up tgctl up -f "$SPEC"
fi
step status tgctl status -f "$SPEC"
step train tgctl train -f "$SPEC" --steps "$STEPS"
# Two GPU workers (the TP=2 seed) on this head: must be refused at once, naming what exists.
step infeasible tgctl up -f examples/local/seed-gpu.yaml
step down tgctl down -f "$SPEC"
tgctl down -f "$SPEC" --stop-ray >> "$LOG" 2>&1

python3 - "$OUT" <<PY | tee "$OUT/flow.json"
import json, sys
out = sys.argv[1]
import re
# tgctl train's human step lines: "step 2/5: loss 5.9098, grad norm 12.820, 54,351 tokens/s, 0.301 s"
STEP = re.compile(r"^step \d+/\d+: loss ([\d.]+), grad norm [\d.]+, ([\d,]+) tokens/s, ([\d.]+) s")
steps = []
for line in open(f"{out}/train.out"):
    m = STEP.match(line.strip())
    if m:
        steps.append({"loss": float(m[1]), "tokens_per_s": float(m[2].replace(",", "")),
                      "step_time_s": float(m[3])})
print(json.dumps({
    "spec": "$SPEC",
    "seconds": {"up": ${SECS[up]}, "status": ${SECS[status]}, "train": ${SECS[train]},
                "infeasible_up": ${SECS[infeasible]}, "down": ${SECS[down]}},
    "rc": {"up": ${RC[up]}, "status": ${RC[status]}, "train": ${RC[train]},
           "infeasible_up": ${RC[infeasible]}, "down": ${RC[down]}},
    "step_time_ms": [round(s["step_time_s"] * 1e3, 1) for s in steps],
    "loss": [round(s["loss"], 4) for s in steps],
    "tokens_per_s": [round(s["tokens_per_s"]) for s in steps],
}, indent=1))
PY
grep -h -E "tgctl up:|can never be placed" "$OUT/infeasible.err" | head -3
echo "total $(python3 -c "print(round($(date +%s.%N) - $T0, 1))")s"
