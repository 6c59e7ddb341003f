#!/usr/bin/env bash
# bench/decode_profile.py on one GPU: the decode step's kernels, lean (compiled) and modules.
#   bash bench/gpu/decode_profile.sh [extra args]   (carry .whl/carry)  writes $OUT/decode_profile_*.json
set -uo pipefail
source bench/gpu/carried_env.sh
for lean in 1 0; do
  TG_SAMPLER_LEAN=$lean timeout 300 python3 bench/decode_profile.py --json "$OUT/decode_profile_lean$lean.json" "$@" \
    2> >(grep -v -i -E "warn|megatron_fsdp|apex|deprecat|Rewrapping" >&2) || echo "decode_profile: lean=$lean exited $?"
done
