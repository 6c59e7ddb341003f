#!/usr/bin/env bash
# The decode step's paths on one GPU, in one run (docs/sampling.md, "The decode step"): the
# lean layers compiled with the Triton decode attention (the default), the same with masked
# SDPA, uncompiled, and the model's modules, each under CUDA graphs, on the seed shape and the 5.1 B `large` preset, batch 1 and 32.
#   bash bench/gpu/decode_paths.sh     (carry .whl/carry)   writes $OUT/decode_paths_*.{json,log}
set -uo pipefail
source bench/gpu/carried_env.sh
for preset in seed large; do
  paths=(graphs graphs-sdpa graphs-modules graphs-uncompiled)
  [ "$preset" = large ] && paths=(graphs graphs-sdpa graphs-modules)
  timeout 420 python3 bench/sampling.py --preset "$preset" --device cuda --batches 1 32 \
    --paths "${paths[@]}" --no-transformers --json "$OUT/decode_paths_$preset.json" \
    2> >(tee "$OUT/decode_paths_$preset.log" | grep -v -i -E "warn|megatron_fsdp|apex|deprecat|Rewrapping" >&2) \
    || echo "decode_paths: $preset exited $?"
done
