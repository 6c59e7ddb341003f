#!/usr/bin/env bash
# Concurrent sample requests, continuous engine vs one-shot, on one GPU (docs/sampling.md).
#   bash bench/gpu/sampling_concurrent.sh [extra args]   (carry .whl/carry, as run_on_device.sh)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD/api:$PWD/runtime:$PWD/operator:$PWD/bench" PYTHONUNBUFFERED=1
python3 bench/sampling_concurrent.py --device cuda --json "$OUT/sampling_concurrent.json" "$@" 2> >(tee "$OUT/sampling_concurrent.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
