#!/usr/bin/env bash
# A cookbook-shaped RL loop through the SDK on one H200, watching the group's memory
# (bench/rl_memory.py; docs/tinker.md). Carry .whl/carry (tools/device-carry.sh: both tarballs).
#   bash bench/gpu/rl_memory.sh [extra args]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
mkdir -p "$SITE"
[ -d "$SITE/ray" ] || tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
[ -d "$SITE/tinker" ] || tar -C "$SITE" -xJf .whl/carry/tinker-py312.tar.xz || { echo "unpack failed"; exit 2; }
export PYTHONPATH="$SITE:$PWD/api:$PWD/runtime:$PWD/operator:$PWD/bench"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TG_RAY_INCLUDE_DASHBOARD=0 TINKER_TELEMETRY=0
unset RAY_ADDRESS TG_RAY_ADDRESS
PYDIR="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
if [ ! -x "$PYDIR/ray" ]; then  # the carried ray has no console script
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' "$PYDIR/python3" > "$PYDIR/ray"
  chmod +x "$PYDIR/ray"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 bench/rl_memory.py --preset seed --iters "${ITERS:-45}" --json "$OUT/rl_memory_h200.json" "$@" \
  2> >(tee "$OUT/rl_memory_h200.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
