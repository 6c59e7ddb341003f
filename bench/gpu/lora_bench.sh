#!/usr/bin/env bash
# Runs on the lent GPU machine: LoRA against full weights, and many runs on one group
# (bench/gpu/lora_bench.py; docs/lora.md). Carry .whl/carry (tools/device-carry.sh).
#   bash bench/gpu/lora_bench.sh [args]      writes $OUT/lora_bench.{json,log}
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
SRC="${TG_SRC:-$PWD}"  # a `git archive` export, carried, when the tree holds others' edits
export PYTHONPATH="$SITE:$SRC/api:$SRC/runtime:$SRC/operator:$PWD/bench" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.draw --format=csv,noheader
python3 bench/gpu/lora_bench.py --json "$OUT/lora_bench.json" "$@" \
  2> >(tee "$OUT/lora_bench.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
