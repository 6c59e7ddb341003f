#!/usr/bin/env bash
# Build the stand-in base images from Debian's packages (no image registry is reachable here).
#
#   hack/images/build-bases.sh          build (or reuse) the bases; prints "debian=TAG",
#                                       "operator=TAG" and "runtime=TAG" on the last three lines
#   hack/images/build-bases.sh --print  print those three lines only; build nothing
#
# Three images, all tagged with a hash of this script (the recipe), so an unchanged recipe is
# reused instantly and a changed one builds a fresh set:
#   trainergroup.local/debian:bookworm-<h>       debootstrap --variant=minbase bookworm + the
#                                                packages below, `docker import`ed
#   trainergroup.local/base-python:bookworm-<h>  stands in for python:3.12.12-slim-bookworm:
#                                                `python`, `pip` (and python3, pip3) on PATH,
#                                                pip usable system-wide (no PEP 668 marker), venv
#   trainergroup.local/base-ray:bookworm-<h>     stands in for rayproject/ray:2.60.0-py312-gpu:
#                                                user `ray` uid 1000 gid 100 (users), home
#                                                /home/ray, USER ray, a venv owned by 1000:100 at
#                                                /home/ray/anaconda3 first on PATH (also for login
#                                                shells: KubeRay runs `bash -lc`), bash, wget and
#                                                grep (KubeRay's probes), procps
# Differences from production: Debian's Python is 3.11 (not 3.12), no CUDA libraries in the
# base (torch's nvidia-* wheels bring their own), no conda, no sudo. docs/images.md.
set -euo pipefail

# shellcheck disable=SC2034  # kept for symmetry with build.sh
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DOCKER="${DOCKER:-/usr/bin/docker}"
export DOCKER_BUILDKIT=1
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=python3,python3-venv,python3-pip,ca-certificates,netbase,tzdata,wget,procps,bash,grep

log() { printf '%s build-bases: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
have() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

import_debian() {  # <tag>: debootstrap a minbase rootfs and `docker import` it
  local t0=$SECONDS
  command -v debootstrap >/dev/null || { log "installing debootstrap"; apt-get install -y debootstrap >&2; }
  ROOT="$(mktemp -d /var/tmp/tg-debootstrap.XXXXXX)"
  trap 'rm -rf "$ROOT"' EXIT
  log "debootstrap --variant=minbase $SUITE ($MIRROR) + $PACKAGES"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >&2
  # Like Docker's debian images: no apt caches or package lists; an apt that works in builds.
  chroot "$ROOT" apt-get clean
  rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/log/*.log \
         "$ROOT"/var/cache/debconf/*-old "$ROOT"/var/lib/dpkg/*-old
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
    "$MIRROR" "$SUITE" "$MIRROR" "$SUITE" "$SUITE" > "$ROOT/etc/apt/sources.list"
  : > "$ROOT/etc/resolv.conf"; : > "$ROOT/etc/hostname"
  tar --numeric-owner --xattrs -C "$ROOT" -c . \
    | "$DOCKER" import --change 'CMD ["bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        - "$1" >&2
  rm -rf "$ROOT"; trap - EXIT
  log "imported $1 in $((SECONDS - t0)) s"
}

# Two recipe hashes: the Debian rootfs (suite, mirror, packages, import_debian) and the bases
# (that one plus this whole script minus its comment lines: editing a comment rebuilds nothing). Changing
# only the bases' Dockerfiles below reuses the debootstrapped image.
DEBIAN_HASH="$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "$(declare -f import_debian)" | sha256sum | cut -c1-12)"
HASH="$( (grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; echo "$DEBIAN_HASH") | sha256sum | cut -c1-12)"
DEBIAN_TAG="trainergroup.local/debian:$SUITE-$DEBIAN_HASH"
PYTHON_TAG="trainergroup.local/base-python:$SUITE-$HASH"
RAY_TAG="trainergroup.local/base-ray:$SUITE-$HASH"

result() { echo "debian=$DEBIAN_TAG"; echo "operator=$PYTHON_TAG"; echo "runtime=$RAY_TAG"; }

if [[ "${1:-}" == "--print" ]]; then result; exit 0; fi
if have "$DEBIAN_TAG" && have "$PYTHON_TAG" && have "$RAY_TAG"; then log "cached: $PYTHON_TAG $RAY_TAG"; result; exit 0; fi

# One builder at a time (two test sessions starting together).
mkdir -p "${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup"
exec 8>"${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/build-bases.lock"
flock -w 1800 8 || { log "ERROR: timed out waiting for another build-bases.sh"; exit 1; }
if have "$DEBIAN_TAG" && have "$PYTHON_TAG" && have "$RAY_TAG"; then log "built meanwhile: $PYTHON_TAG $RAY_TAG"; result; exit 0; fi

T0=$SECONDS
have "$DEBIAN_TAG" || import_debian "$DEBIAN_TAG"

T1=$SECONDS
# Empty build context: everything comes from the imported Debian image.
CTX="$(mktemp -d)"; trap 'rm -rf "$CTX"' EXIT
"$DOCKER" build -q -t "$PYTHON_TAG" --build-arg "DEBIAN=$DEBIAN_TAG" -f - "$CTX" >&2 <<'DOCKERFILE'
ARG DEBIAN
FROM ${DEBIAN}
# The official python image: python/pip on PATH, pip allowed outside a venv.
RUN ln -s /usr/bin/python3 /usr/local/bin/python \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip \
 && rm -f /usr/lib/python3.*/EXTERNALLY-MANAGED \
 && python --version && pip --version && python -m venv --help >/dev/null
CMD ["python3"]
DOCKERFILE
"$DOCKER" build -q -t "$RAY_TAG" --build-arg "DEBIAN=$DEBIAN_TAG" -f - "$CTX" >&2 <<'DOCKERFILE'
ARG DEBIAN
FROM ${DEBIAN}
# rayproject/ray: user ray (1000, group users=100), home /home/ray, its Python first on PATH.
RUN useradd --uid 1000 --gid 100 --create-home --home-dir /home/ray --shell /bin/bash ray \
 && python3 -m venv /home/ray/anaconda3 \
 && mkdir -p /home/ray/.cache/pip \
 && ln -s python3 /home/ray/anaconda3/bin/python 2>/dev/null || true \
 && chown -R 1000:100 /home/ray \
 && echo 'export PATH=/home/ray/anaconda3/bin:$PATH' > /etc/profile.d/00-ray-python.sh \
 && echo 'export PATH=/home/ray/anaconda3/bin:$PATH' >> /home/ray/.bashrc
ENV PATH=/home/ray/anaconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/home/ray
USER 1000:100
WORKDIR /home/ray
RUN python --version && pip --version && test -w /home/ray/anaconda3/lib \
 && bash -lc 'command -v python' | grep -q /home/ray/anaconda3 && command -v wget
CMD ["bash"]
DOCKERFILE
log "built $PYTHON_TAG and $RAY_TAG in $((SECONDS - T1)) s (total $((SECONDS - T0)) s)"
result
