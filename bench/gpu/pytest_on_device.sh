#!/usr/bin/env bash
# Run pytest on the lent GPU machine with the carried packages (tools/device-carry.sh;
# carry: [".whl/carry"]):   bash bench/gpu/pytest_on_device.sh tests/trainer/test_trainer_gpu.py ...
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
if [ ! -d "$SITE/ray" ]; then
  mkdir -p "$SITE" && tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD:$PWD/api:$PWD/runtime"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
unset RAY_ADDRESS TG_RAY_ADDRESS
PYDIR="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
if [ ! -x "$PYDIR/ray" ]; then  # the carried ray has no console script
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' "$PYDIR/python3" > "$PYDIR/ray"
  chmod +x "$PYDIR/ray"
fi
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | grep -v -i -E "warn|megatron_fsdp|apex" | tail -40
exit "${PIPESTATUS[0]}"
