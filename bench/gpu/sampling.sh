#!/usr/bin/env bash
# The sampler against transformers' generate on the seed shape, one GPU (docs/sampling.md).
#   bash bench/gpu/sampling.sh [extra args]   (carry .whl/carry, as run_on_device.sh)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD/api:$PWD/runtime:$PWD/operator:$PWD/bench" PYTHONUNBUFFERED=1
python3 bench/sampling.py --preset seed --device cuda --json "$OUT/sampling_h200.json" "$@" 2> >(tee "$OUT/sampling_h200.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
