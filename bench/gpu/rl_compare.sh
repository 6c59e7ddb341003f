#!/usr/bin/env bash
# Several cookbook-shaped RL runs through the SDK (bench/rl_memory.py --compare-client), one
# after another on one device, each to $OUT/rl_compare_NAME.json (docs/tinker.md). Carry
# .whl/carry (tools/device-carry.sh). Each argument is NAME=ARGS, ARGS being rl_memory.py's:
#   bash bench/gpu/rl_compare.sh "full=--preset seed" "lora32=--preset seed --lora 32" \
#       "w1=--preset seed ENV:TG_SAMPLER_WINDOW=1"
# ENV:K=V words set K=V for that run only. Common flags: COMMON (default: the issue's shape,
# 8 prompts x 8 samples x 256 tokens, 6 iterations, a small big call).
set -uo pipefail
source "$(dirname "$0")/carried_env.sh"
COMMON="${COMMON:---compare-client --prompts 8 --group 8 --max-tokens 256 --iters 6 --big-rows 16 --big-len 128}"
for spec in "$@"; do
  name="${spec%%=*}"; words=(${spec#*=}); args=(); envs=()
  for w in "${words[@]}"; do
    if [[ "$w" == ENV:* ]]; then envs+=("${w#ENV:}"); else args+=("$w"); fi
  done
  echo "== $name: ${envs[*]} ${args[*]}"
  env "${envs[@]}" python3 bench/rl_memory.py $COMMON "${args[@]}" \
    --json "$OUT/rl_compare_$name.json" 2> "$OUT/rl_compare_$name.log" \
    | grep -E "^ +[0-9]+ |median_sdk|first_over|median_sample|\"median_s\"" 
  echo "rc=${PIPESTATUS[0]}"; grep -E "Error|error:" "$OUT/rl_compare_$name.log" | tail -3
done
