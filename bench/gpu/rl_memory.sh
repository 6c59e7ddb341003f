#!/usr/bin/env bash
# A cookbook-shaped RL loop through the SDK on one H200, watching the group's memory
# (bench/rl_memory.py; docs/tinker.md). Carry .whl/carry (tools/device-carry.sh: both tarballs).
#   bash bench/gpu/rl_memory.sh [extra args]
set -uo pipefail
source "$(dirname "$0")/carried_env.sh"
python3 bench/rl_memory.py --preset seed --iters "${ITERS:-45}" --json "$OUT/rl_memory_h200.json" "$@" \
  2> >(tee "$OUT/rl_memory_h200.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
