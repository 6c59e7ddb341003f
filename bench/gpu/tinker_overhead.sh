#!/usr/bin/env bash
# The Tinker server's cost on one H200 (docs/tinker.md): the SDK's forward_backward + optim_step
# through the server against the same TrainerClient calls, seed shape (TP=1, 16 x 1024).
#   bash bench/gpu/tinker_overhead.sh [extra args]   (carry .whl/carry, built by tools/device-carry.sh)
set -uo pipefail
source "$(dirname "$0")/carried_env.sh"
python3 -c 'import torch, ray, tinker, aiohttp, httpx; print("torch", torch.__version__, "ray", ray.__version__, "tinker", tinker.__version__, "aiohttp", aiohttp.__version__, "httpx", httpx.__version__)' || exit 3
python3 bench/tinker_overhead.py --preset seed --tp 1 --batch 16 --seq 1024 \
  --steps "${STEPS:-8}" --rounds "${ROUNDS:-3}" --json "$OUT/tinker_overhead_h200.json" "$@" \
  2> >(tee "$OUT/tinker_overhead_h200.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
