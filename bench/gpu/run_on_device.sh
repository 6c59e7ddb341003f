#!/usr/bin/env bash
# Runs on the lent GPU machine (docs/gpu.md): unpack the carried Python 3.12 packages
# (ray, megatron-core, tensordict and the few dependencies the image lacks), then run the
# step benchmark through a detached group and directly, writing results under $OUT.
#   bash bench/gpu/run_on_device.sh CASE [CASE...]      e.g. seed:tp1 large:tp1 seed:tp2
# The carried tarball .whl/carry/site-py312.tar.xz is built here by tools/device-carry.sh
# (pass carry: [".whl/carry"] to the device call).
set -uo pipefail
T0=$(date +%s)
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
# TG_SITE_FIRST: a folder put before the carried packages (bench/gpu/stack_compare.sh puts
# megatron-core 0.16.1 there to time the stack before issue 36's move in the same session).
export PYTHONPATH="${TG_SITE_FIRST:+$TG_SITE_FIRST:}$SITE:$PWD/api:$PWD/runtime:$PWD/operator:$PWD/bench"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TG_RAY_INCLUDE_DASHBOARD="${TG_RAY_INCLUDE_DASHBOARD:-0}"
PYDIR="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
# The carried ray has no console script: put a `ray` next to the interpreter.
if [ ! -x "$PYDIR/ray" ]; then
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' "$PYDIR/python3" > "$PYDIR/ray"
  chmod +x "$PYDIR/ray"
fi
echo "unpacked in $(( $(date +%s) - T0 ))s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY'
import torch, ray, tensordict, megatron.core as mc
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("ray", ray.__version__, "tensordict", tensordict.__version__, "megatron-core", mc.__version__)
PY
ARGS=()
for c in "$@"; do ARGS+=(--case "$c"); done
python3 bench/bench_group_step.py "${ARGS[@]}" --steps "${STEPS:-20}" --warmup "${WARMUP:-5}" \
  ${EXTRA_ARGS:-} --json "$OUT/gpu_step.json" 2> >(tee "$OUT/gpu_step.log" | grep -v -i -E "warn|megatron_fsdp|apex" >&2)
rc=$?
echo "total $(( $(date +%s) - T0 ))s rc=$rc"
exit $rc
