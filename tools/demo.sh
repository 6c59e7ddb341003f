#!/usr/bin/env bash
# The demo on the embedded default (local Ray on CPU): up -> train with TP=2 -> down.
#   ./tools/demo.sh [SPEC.yaml] [STEPS]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SPEC="${1:-examples/local/tiny-cpu.yaml}"
STEPS="${2:-5}"
TG_EXTRAS=runtime,operator ./tools/install.sh
TGCTL="$ROOT/.venv/bin/tgctl"
cleanup() { "$TGCTL" down -f "$SPEC" --stop-ray >/dev/null 2>&1 || true; }
trap cleanup EXIT
echo "== tgctl up -f $SPEC"
"$TGCTL" up -f "$SPEC"
echo "== tgctl status -f $SPEC"
"$TGCTL" status -f "$SPEC"
echo "== tgctl train -f $SPEC --steps $STEPS"
"$TGCTL" train -f "$SPEC" --steps "$STEPS"
echo "== tgctl down -f $SPEC --stop-ray"
trap - EXIT
"$TGCTL" down -f "$SPEC" --stop-ray
