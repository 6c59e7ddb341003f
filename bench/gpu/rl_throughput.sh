#!/usr/bin/env bash
# forward_backward+optim_step vs train_model on the seed shape, one GPU (docs/trainer.md).
#   bash bench/gpu/rl_throughput.sh [extra args]   (carry .whl/carry, as run_on_device.sh)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD/api:$PWD/runtime:$PWD/operator:$PWD/bench" PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
python3 bench/gpu/rl_throughput.py --preset seed --json "$OUT/rl_throughput.json" "$@" 2> >(tee "$OUT/rl_throughput.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
