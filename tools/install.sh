#!/usr/bin/env bash
# Install everything the project needs into ./.venv (idempotent; fast when already done).
# Uses uv (installed from PyPI if missing); uv's cache under ~/.cache/uv makes re-runs quick.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TG_VENV:-$ROOT/.venv}"
EXTRAS="${TG_EXTRAS:-runtime,operator,dev}"
log() { printf '%s install: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

PY="${TG_PYTHON_BIN:-$(command -v python3.11 || command -v python3)}"
"$PY" - <<'PYEOF' || { echo "install: Python >= 3.11 is required (found $("$PY" --version 2>&1)); install it and retry" >&2; exit 2; }
import sys
raise SystemExit(0 if sys.version_info >= (3, 11) else 1)
PYEOF

if ! command -v uv >/dev/null 2>&1; then
  log "installing uv from PyPI"
  "$PY" -m pip install -q --disable-pip-version-check uv
fi
UV="$(command -v uv || echo "$("$PY" -m site --user-base)/bin/uv")"

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$UV" venv -q -p "$PY" "$VENV"
fi
STAMP="$VENV/.tg-installed"
HASH="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$EXTRAS"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  log "installing .[${EXTRAS}] (torch is a few GB the first time; cached afterwards)"
  "$UV" pip install -q -p "$VENV/bin/python" -e "$ROOT[${EXTRAS}]"
  echo "$HASH" > "$STAMP"
else
  log "python packages up to date"
fi
# tinker-cookbook 0.5.8 pins an older transformers/tokenizers than .venv's, so it gets a venv
# of its own layered over this one (hack/cookbook-venv.sh), in $VENV/cookbook: it belongs to
# this venv and goes with it. tests/service/test_cookbook.py runs the cookbook with it.
if [[ ",$EXTRAS," == *",dev,"* ]]; then
  CB="$VENV/cookbook"
  CB_HASH="$(cat "$ROOT/hack/cookbook-venv.sh" "$STAMP" | sha256sum | cut -c1-16)"
  if [ "$(cat "$CB/.tg-installed" 2>/dev/null)" != "$CB_HASH" ]; then
    log "installing tinker-cookbook into $CB (hack/cookbook-venv.sh)"
    rm -rf "$CB"
    UV="$UV" TG_BASE_VENV="$VENV" bash "$ROOT/hack/cookbook-venv.sh" "$CB" >/dev/null
    echo "$CB_HASH" > "$CB/.tg-installed"
  fi
fi
log "ready: $VENV"
