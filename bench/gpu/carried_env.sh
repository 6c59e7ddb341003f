# Sourced by the SDK benchmarks' device scripts (rl_memory.sh, tinker_overhead.sh), run from
# the repository root: unpacks the carried site-packages (.whl/carry, built by
# tools/device-carry.sh: the runtime's closure and the tinker SDK's) into /tmp/tgsite, points
# PYTHONPATH at them and at the repo's packages, gives the carried ray its console script,
# and prints the GPU. Sets OUT (default /tmp/out). Exits 2 if a tarball does not unpack.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
SITE=/tmp/tgsite
mkdir -p "$SITE"
[ -d "$SITE/ray" ] || tar -C "$SITE" -xJf .whl/carry/site-py312.tar.xz || { echo "unpack failed"; exit 2; }
[ -d "$SITE/tinker" ] || tar -C "$SITE" -xJf .whl/carry/tinker-py312.tar.xz || { echo "unpack failed"; exit 2; }
export PYTHONPATH="$SITE:$PWD/api:$PWD/runtime:$PWD/operator:$PWD/bench"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 TG_RAY_INCLUDE_DASHBOARD=0 TINKER_TELEMETRY=0
unset RAY_ADDRESS TG_RAY_ADDRESS
PYDIR="$(dirname "$(python3 -c 'import sys; print(sys.executable)')")"
if [ ! -x "$PYDIR/ray" ]; then  # the carried ray has no console script
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.exit(main())" "$@"\n' "$PYDIR/python3" > "$PYDIR/ray"
  chmod +x "$PYDIR/ray"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
