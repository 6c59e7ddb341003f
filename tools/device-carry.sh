#!/usr/bin/env bash
# Build .whl/carry/site-py312.tar.xz: the Python packages the lent GPU machine's image lacks
# (ray[default] 2.60.0, megatron-core 0.16.1, tensordict and their missing dependencies),
# as one xz tarball that bench/gpu/run_on_device.sh unpacks into /tmp/tgsite.
#
#   tools/device-carry.sh            # writes .whl/carry/site-py312.tar.xz (+ .sha256, .txt)
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

PY="${PYTHON:-python3}"
WHEELS=.whl/wheels          # downloaded wheels (kept: a re-run downloads nothing new)
BUILD=.whl/build/site       # unpacked site-packages
OUT=.whl/carry/site-py312.tar.xz

# The runtime's heavy requirements (pyproject.toml) ...
TOP=(
  ray==2.60.0
  megatron-core==0.16.1
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
PLATFORM=(
  --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform any
)
# Parts of the ray package the runtime never imports (and the Java jars).
PRUNE=(ray/jars ray/rllib ray/serve ray/tune ray/train ray/data ray/llm)

mkdir -p "$WHEELS" "$(dirname "$OUT")"
echo "== downloading ${#TOP[@]} + ${#DEPS[@]} wheels into $WHEELS"
"$PY" -m pip download -q --disable-pip-version-check --no-deps "${PLATFORM[@]}" -d "$WHEELS" \
  "${TOP[@]}" "${DEPS[@]}"

echo "== installing into $BUILD"
rm -rf "$BUILD"; mkdir -p "$BUILD"
"$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WHEELS" --no-deps \
  --no-compile --target "$BUILD" "${PLATFORM[@]}" "${TOP[@]}" "${DEPS[@]}"

for p in "${PRUNE[@]}"; do rm -rf "${BUILD:?}/$p"; done
find "$BUILD" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf "$BUILD/bin"   # console scripts made here point at this machine's python

echo "== packing $OUT"
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=gnu -C "$BUILD" -cf - . \
  | xz -9 -T1 -c > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
sha256sum "$OUT" | tee "$OUT.sha256"
printf '%s\n' "${TOP[@]}" "${DEPS[@]}" > "$(dirname "$OUT")/packages.txt"
size=$(stat -c %s "$OUT")
echo "== $OUT: $((size / 1024 / 1024)) MiB ($(du -sh "$BUILD" | cut -f1) unpacked)"
if (( size > 56 * 1024 * 1024 )); then
  echo "warning: over 56 MiB: with the working tree it may not fit a device call's 64 MiB" >&2
fi
