#!/usr/bin/env bash
# The test command: installs what is needed, then runs every check and test that can run here.
#   ./tools/test.sh            everything (lint, types, unit, Ray, Megatron-on-CPU, Kubernetes plane)
#   ./tools/test.sh -k api     extra arguments go to pytest
# Tiers that cannot run on this machine (GPU) are skipped by pytest with their reason. The kind
# tier (real pods, tests/e2e) runs here: this script starts the Docker engine it needs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
log() { printf '%s test: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
T0=$(date +%s)

# Real pods on kind need a Docker engine: install Debian's docker.io if absent and start
# dockerd if it is not running (tests/e2e skips with the reason if this fails).
log "Docker engine (hack/docker/up.sh)"
PREBUILD_PID=""
PREBUILD_LOG="${TMPDIR:-/tmp}/tg-images-prebuild.$$.log"
if bash hack/docker/up.sh; then
  # The images' builds download wheels and unpack them (network and disk) while the Go
  # build below keeps the CPUs busy; the kind tests reuse what this builds (cached by Docker).
  log "building the images in the background (log: $PREBUILD_LOG)"
  bash hack/images/build.sh operator runtime > "$PREBUILD_LOG" 2>&1 &
  PREBUILD_PID=$!
  trap 'kill "$PREBUILD_PID" 2>/dev/null || true' EXIT   # an early exit stops it too
else
  log "no Docker engine: the kind tests will be skipped (see the messages above)"
fi

./tools/install.sh || { log "install failed: see the messages above"; exit 2; }
PY="$ROOT/.venv/bin/python"
export PATH="$ROOT/.venv/bin:$PATH"

# No Go toolchain (the same search as hack/build-tools.sh): nothing is built and pytest skips
# the Kubernetes tiers (k8s, deploy on the plane) with that reason. A Go that is there but
# fails to build is a hard failure (exit 2): docs/control-plane.md, "Tests".
if [ -n "${GO:-}" ] || command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ]; then
  log "building the local Kubernetes control plane tools (cached by version after the first build)"
  bash hack/build-tools.sh || { log "control-plane build failed: see the messages above"; exit 2; }
else
  log "no Go toolchain: the Kubernetes control-plane tests will be skipped with that reason"
fi

if [ -n "$PREBUILD_PID" ]; then
  if wait "$PREBUILD_PID"; then
    trap - EXIT
    log "images built: $(grep -o 'times: .*' "$PREBUILD_LOG" | tail -n 1)"
  else
    log "the background image build failed (the kind test rebuilds and reports); its tail:"
    tail -n 20 "$PREBUILD_LOG" >&2
  fi
fi

status=0
log "ruff"
"$PY" -m ruff check . || status=1
log "mypy --strict (api, operator, runtime)"
"$PY" -m mypy || status=1
log "CRD is generated from the spec model"
"$PY" -m tgapi.crd --check . || status=1

log "pytest"
"$PY" -m pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then log "pytest collected no tests"; rc=1; fi
[ $rc -ne 0 ] && status=$rc
log "finished in $(( $(date +%s) - T0 ))s with status $status"
exit $status
