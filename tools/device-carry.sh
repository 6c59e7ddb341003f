#!/usr/bin/env bash
# Build .whl/carry/site-py312.tar.xz: the Python packages the lent GPU machine's image lacks
# (ray[default] 2.60.0, megatron-core 0.19.2, tensordict and their missing dependencies),
# as one xz tarball that bench/gpu/run_on_device.sh unpacks into /tmp/tgsite; and
# .whl/carry/tinker-py312.tar.xz: the tinker 0.38.0 SDK and what of its closure the image lacks
# (bench/gpu/tinker_overhead.sh unpacks both). Two tarballs so that adding the SDK does not
# repack Ray (a single-threaded xz -9 of ~200 MB is many minutes on a loaded machine).
#
#   tools/device-carry.sh            # writes .whl/carry/{site,tinker}-py312.tar.xz (+ .sha256, .txt)
#   tools/device-carry.sh tinker     # only the tinker tarball
#   tools/device-carry.sh mcore016   # only .whl/carry/mcore016-py312.tar.xz: megatron-core
#                                    # 0.16.1, the stack before issue 36's move, for
#                                    # bench/gpu/stack_compare.sh's old-vs-new step figures
#   then: run(command="bash bench/gpu/run_on_device.sh ...", carry=[".whl/carry"])
#
# Why a tarball and not wheels: Ray's cp312 wheel alone is ~79 MB, over a device call's
# 64 MiB (tree + carried paths). Unpacked, without Ray's jars and its rllib/serve/tune/train/
# data/llm libraries (the runtime never imports them) and repacked with xz, the whole set is
# ~30 MB.
#
# Reproducible: every package is pinned below (the closure of the runtime's requirements,
# minus what the device image already has: /work/.library/device/KINDS.md's package list,
# read 2026-11-17); wheels only, for CPython 3.12 on manylinux x86_64; the tarball is made
# with sorted names, fixed mtimes and owners, and single-threaded xz, so the same inputs give
# the same bytes. Needs: a python3 with pip (any version >= 3.9 works: --python-version
# selects the target), network access to the package index, tar, xz.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

# A Python 3.12 with pip: pip checks each wheel's requires-python against the interpreter it
# runs on even with --target, and megatron-core 0.19 requires >= 3.12. PYTHON wins; else
# python3.12 on PATH, pyenv's 3.12 build, or python3.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in "$(command -v python3.12 || true)" "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 python3; do
    if [ -n "$c" ] && "$c" -c 'import sys, pip; raise SystemExit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      PY="$c"; break
    fi
  done
fi
[ -n "$PY" ] || { echo "device-carry: needs a Python 3.12 with pip (set PYTHON=...)" >&2; exit 2; }
WHEELS=.whl/wheels          # downloaded wheels (kept: a re-run downloads nothing new)
BUILD=.whl/build/site       # unpacked site-packages
OUT=.whl/carry/site-py312.tar.xz

# The runtime's heavy requirements (pyproject.toml) ...
TOP=(
  ray==2.60.0
  megatron-core==0.19.2
  tensordict==0.15.3
)
# ... and the dependencies of ray[default], megatron-core and tensordict that the image lacks.
# (The image has torch 2.11, numpy, aiohttp, grpcio, protobuf, pyyaml, requests, msgpack,
# click, filelock, packaging, prometheus-client, cloudpickle, psutil and the rest.)
DEPS=(
  pyvers==0.2.3
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  aiohttp-cors==0.8.1 colorful==0.5.8 py-spy==0.4.3 smart-open==9.0.2
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.63.0
  googleapis-common-protos==1.76.0 proto-plus==1.29.0 pyasn1==0.6.5 pyasn1-modules==0.4.2
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-semantic-conventions==0.66b2
  virtualenv==21.15.11 distlib==0.4.4 platformdirs==4.14.9 python-discovery==1.9.6
)
# The tinker SDK (bench/tinker_overhead.py's client) and what of its closure the image lacks:
# httpx[http2]'s h2, distro, sniffio, orjson, zstandard, pyqwest (its opentelemetry-api and
# pydantic are in the site tarball). The image's httpx, anyio, click, rich, protobuf,
# transformers and the server's aiohttp (with its multidict/yarl/frozenlist set) are used as
# they are.
TINKER=(
  tinker==0.38.0 pyqwest==0.12.0 orjson==3.13.0 zstandard==0.25.0 distro==1.9.0 sniffio==1.3.1
  h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0
)
PLATFORM=(
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform any
)
# Parts of the ray package the runtime never imports (and the Java jars).
PRUNE=(ray/jars ray/rllib ray/serve ray/tune ray/train ray/data ray/llm)

mkdir -p "$WHEELS" "$(dirname "$OUT")"

# pack OUT BUILD PACKAGE...: download, install into BUILD, prune, tar | xz into OUT.
pack() {
  local out="$1" build="$2"; shift 2
  echo "== downloading $# wheels into $WHEELS"
  "$PY" -m pip download -q --disable-pip-version-check --no-deps "${PLATFORM[@]}" -d "$WHEELS" "$@"
  echo "== installing into $build"
  rm -rf "$build"; mkdir -p "$build"
  "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps \
    --no-compile --target "$build" "${PLATFORM[@]}" "$@"
  for p in "${PRUNE[@]}"; do rm -rf "${build:?}/$p"; done
  find "$build" -name __pycache__ -type d -prune -exec rm -rf {} +
  rm -rf "$build/bin"   # console scripts made here point at this machine's python
  echo "== packing $out"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=gnu -C "$build" -cf - . \
    | xz -9 -T1 -c > "$out.tmp"
  mv "$out.tmp" "$out"
  sha256sum "$out" | tee "$out.sha256"
  printf '%s\n' "$@" > "${out%.tar.xz}.packages.txt"
  echo "== $out: $(( $(stat -c %s "$out") / 1024 / 1024 )) MiB ($(du -sh "$build" | cut -f1) unpacked)"
}

case "${1:-}" in
  mcore016) pack "$(dirname "$OUT")/mcore016-py312.tar.xz" .whl/build/mcore016 megatron-core==0.16.1 ;;
  tinker) pack "$(dirname "$OUT")/tinker-py312.tar.xz" .whl/build/tinker "${TINKER[@]}" ;;
  *)
    pack "$OUT" "$BUILD" "${TOP[@]}" "${DEPS[@]}"
    cp "${OUT%.tar.xz}.packages.txt" "$(dirname "$OUT")/packages.txt"
    pack "$(dirname "$OUT")/tinker-py312.tar.xz" .whl/build/tinker "${TINKER[@]}"
    ;;
esac
size=$(du -cb .whl/carry/*.tar.xz | tail -1 | cut -f1)
echo "== .whl/carry: $((size / 1024 / 1024)) MiB"
if (( size > 56 * 1024 * 1024 )); then
  echo "warning: over 56 MiB: with the working tree it may not fit a device call's 64 MiB" >&2
fi
