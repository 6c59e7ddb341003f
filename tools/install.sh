#!/usr/bin/env bash
# Install everything the project needs into ./.venv (idempotent; fast when already done).
# Uses uv (installed from PyPI if missing); uv's cache under ~/.cache/uv makes re-runs quick.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TG_VENV:-$ROOT/.venv}"
EXTRAS="${TG_EXTRAS:-runtime,operator,dev}"
log() { printf '%s install: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# Python >= 3.12 (megatron-core >= 0.17 needs it). TG_PYTHON_BIN wins; else PATH's python3.12
# if it runs (a pyenv shim for a version that is not the global one is on PATH but fails), else
# pyenv's own 3.12 build, else python3 if it is new enough.
need_312() { "$1" -c 'import sys; raise SystemExit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
find_python() {
  local c
  if [ -n "${TG_PYTHON_BIN:-}" ]; then echo "$TG_PYTHON_BIN"; return; fi
  c="$(command -v python3.12 || true)"
  if [ -n "$c" ] && need_312 "$c"; then echo "$c"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      if [ -x "$c" ] && need_312 "$c"; then echo "$c"; return; fi
    done
  fi
  c="$(command -v python3 || true)"
  if [ -n "$c" ] && need_312 "$c"; then echo "$c"; return; fi
  echo ""
}
PY="$(find_python)"
if [ -z "$PY" ] || ! need_312 "$PY"; then
  found="none"; [ -n "$PY" ] && found="$("$PY" --version 2>&1 || true) at $PY"
  echo "install: Python >= 3.12 is required (megatron-core 0.19 needs it); found: $found." >&2
  echo "install: install Python 3.12 (apt install python3.12, or pyenv install 3.12), put" >&2
  echo "install: python3.12 on PATH or point TG_PYTHON_BIN at it, and retry" >&2
  exit 2
fi
PYVER="$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"

# A uv that runs: PATH's (a pyenv shim for uv installed under another Python version is on
# PATH but exits 127), else the one the uv package of $PY knows, else uv installed from PyPI.
# pip puts uv in the interpreter's scripts folder (pyenv's versions/X/bin, not on PATH until a
# rehash) or, for --user installs, the user base's bin: ask the uv package where its binary is.
uv_of_py() { "$PY" -c 'import uv; print(uv.find_uv_bin())' 2>/dev/null || true; }
UV="$(command -v uv || true)"
if [ -z "$UV" ] || ! "$UV" --version >/dev/null 2>&1; then UV="$(uv_of_py)"; fi
if [ -z "$UV" ] || ! "$UV" --version >/dev/null 2>&1; then
  log "installing uv from PyPI"
  "$PY" -m pip install -q --disable-pip-version-check uv
  UV="$(uv_of_py)"
fi

# A venv on another Python (an old 3.11 .venv, or a different 3.12.x) is replaced, not reused:
# its interpreter and every compiled wheel in it belong to that version.
if [ -x "$VENV/bin/python" ]; then
  have="$("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo broken)"
  if [ "$have" != "$PYVER" ]; then
    log "$VENV is Python $have, not $PYVER ($PY): recreating it"
    rm -rf "$VENV"
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV (Python $PYVER from $PY)"
  "$UV" venv -q -p "$PY" "$VENV"
fi
STAMP="$VENV/.tg-installed"
HASH="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)-$EXTRAS-py$PYVER"
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
