#!/usr/bin/env bash
# Runs on the lent GPU machine: MFU of a random Qwen3-1.7B-shaped model loaded through
# spec.model.pretrained (bench/gpu/qwen3_mfu.py; docs/models.md). Carry .whl/carry.
#   bash bench/gpu/qwen3_mfu.sh [args]      writes $OUT/qwen3_mfu.{json,log}
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
SRC="${TG_SRC:-$PWD}"  # a `git archive` export, carried, when the tree holds others' edits
export PYTHONPATH="$SITE:$SRC/api:$SRC/runtime:$SRC/operator:$PWD/bench" PYTHONUNBUFFERED=1
python3 bench/gpu/qwen3_mfu.py --json "$OUT/qwen3_mfu.json" "$@" \
  2> >(tee "$OUT/qwen3_mfu.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
