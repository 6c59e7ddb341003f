#!/usr/bin/env bash
# The Tinker server's cost on one H200 (docs/tinker.md): the SDK's forward_backward + optim_step
# through the server against the same TrainerClient calls, seed shape (TP=1, 16 x 1024).
#   bash bench/gpu/tinker_overhead.sh [extra args]   (carry .whl/carry, built by tools/device-carry.sh)
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
python3 -c 'import torch, ray, tinker, aiohttp, httpx; print("torch", torch.__version__, "ray", ray.__version__, "tinker", tinker.__version__, "aiohttp", aiohttp.__version__, "httpx", httpx.__version__)' || exit 3
python3 bench/tinker_overhead.py --preset seed --tp 1 --batch 16 --seq 1024 \
  --steps "${STEPS:-8}" --rounds "${ROUNDS:-3}" --json "$OUT/tinker_overhead_h200.json" "$@" \
  2> >(tee "$OUT/tinker_overhead_h200.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
