#!/usr/bin/env bash
# Runs on the lent GPU machine: where the detached group's per-step overhead goes
# (bench/gpu/group_overhead.py; docs/gpu.md). Carry .whl/carry (tools/device-carry.sh).
#   bash bench/gpu/group_overhead.sh [args]      writes $OUT/group_overhead.{json,log}
# TG_SRC: a folder holding api/, runtime/ and operator/ to run instead of the working tree's
# (e.g. a `git archive HEAD` export in .cache/, carried, when the tree holds others' edits).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
SRC="${TG_SRC:-$PWD}"
export PYTHONPATH="$SITE:$SRC/api:$SRC/runtime:$SRC/operator:$PWD/bench" PYTHONUNBUFFERED=1
export RAY_USAGE_STATS_ENABLED=0 TG_RAY_INCLUDE_DASHBOARD="${TG_RAY_INCLUDE_DASHBOARD:-0}"
PYDIR="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
if [ ! -x "$PYDIR/ray" ]; then
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' "$PYDIR/python3" > "$PYDIR/ray"
  chmod +x "$PYDIR/ray"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
python3 bench/gpu/group_overhead.py --json "$OUT/group_overhead.json" "$@" \
  2> >(tee "$OUT/group_overhead.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
