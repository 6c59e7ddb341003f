#!/usr/bin/env bash
# Build the stand-in base images from Debian's packages (no image registry is reachable here).
#
#   hack/images/build-bases.sh          build (or reuse) the bases; prints "debian=TAG",
#                                       "operator=TAG" and "runtime=TAG" on the last three lines
#   hack/images/build-bases.sh --print  print those three lines only; build nothing
#   hack/images/build-bases.sh --stage DIR  copy the CPython the bases get into DIR (trimmed,
#                                       relocated to /usr/local) and stop; builds nothing
#
# Three images, all tagged with a hash of this script (the recipe) and of the CPython copied in,
# so an unchanged recipe is reused instantly and a changed one builds a fresh set:
#   trainergroup.local/debian:bookworm-<h>       debootstrap --variant=minbase bookworm + the
#                                                packages below, `docker import`ed (no Python:
#                                                it is also the KubeRay image's base)
#   trainergroup.local/base-python:bookworm-<h>  stands in for python:3.12.12-slim-bookworm:
#                                                CPython 3.12 in /usr/local, `python`, `pip` (and
#                                                python3, pip3) on PATH, pip usable system-wide, venv
#   trainergroup.local/base-ray:bookworm-<h>     stands in for rayproject/ray:2.60.0-py312-gpu
#                                                (FROM base-python): user `ray` uid 1000 gid 100
#                                                (users), home /home/ray, USER ray, a venv owned by
#                                                1000:100 at /home/ray/anaconda3 first on PATH (also
#                                                for login shells: KubeRay runs `bash -lc`), bash,
#                                                wget and grep (KubeRay's probes), procps
# Python 3.12: bookworm packages only 3.11 and no image registry is reachable, so the bases get
# a copy of the host's CPython 3.12 build (pyenv's: same Debian bookworm, same glibc), trimmed as
# python:slim is and moved to /usr/local, with the Debian libraries its modules link.
# TG_IMAGE_PYTHON=<prefix> picks the build (default: the newest $(pyenv root)/versions/3.12.*).
# Differences from production: that CPython's patch release is the host's (3.12.1 here, 3.12.12
# there), no CUDA libraries in the base (torch's nvidia-* wheels bring their own), no conda, no
# sudo. docs/images.md.
set -euo pipefail

# shellcheck disable=SC2034  # kept for symmetry with build.sh
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DOCKER="${DOCKER:-/usr/bin/docker}"
export DOCKER_BUILDKIT=1
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# No Debian python3 (it is 3.11): the CPython below brings its own. Its modules link these
# libraries (readelf -d on bin/python3.12, libpython3.12.so and lib-dynload/*.so, tkinter left out).
PY_LIBS=libbz2-1.0,libcrypt1,libffi8,liblzma5,libncursesw6,libnsl2,libreadline8,libsqlite3-0,libssl3,libtinfo6,libtirpc3,libuuid1,zlib1g
PACKAGES=ca-certificates,netbase,tzdata,wget,procps,bash,grep,$PY_LIBS

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

# The CPython 3.12 the bases carry: a build on this host (Debian bookworm, the bases' glibc),
# TG_IMAGE_PYTHON=<prefix> (the directory holding bin/python3.12 and lib/python3.12), else the
# newest $(pyenv root)/versions/3.12.*.
find_image_python() {
  local root c
  if [[ -n "${TG_IMAGE_PYTHON:-}" ]]; then echo "$TG_IMAGE_PYTHON"; return; fi
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  c="$(find "$root/versions" -mindepth 1 -maxdepth 1 -name '3.12.[0-9]*' 2>/dev/null | sort -V | tail -1)"
  echo "${c:-$root/versions/3.12.*}"
}
PY_PREFIX="$(find_image_python)"
if ! "$PY_PREFIX/bin/python3.12" -c 'import sys; raise SystemExit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
   || [[ ! -f "$PY_PREFIX/lib/python3.12/os.py" ]]; then
  log "ERROR: the stand-in bases copy a CPython 3.12 build from this host (bookworm packages only"
  log "ERROR: 3.11; megatron-core 0.19 needs 3.12), and there is none at $PY_PREFIX"
  log "ERROR: (bin/python3.12 that runs as 3.12, and lib/python3.12/os.py). Fix: \`pyenv install 3.12\`,"
  log "ERROR: or point TG_IMAGE_PYTHON at the prefix of a CPython 3.12 built on Debian bookworm."
  exit 2
fi
case "$(realpath "$PY_PREFIX")" in
  /|/usr|/usr/local|/opt)
    log "ERROR: TG_IMAGE_PYTHON=$PY_PREFIX is a system directory; the whole prefix is copied, so it must"
    log "ERROR: hold only that CPython (a pyenv build or one configured with its own --prefix)"
    exit 2 ;;
esac
# Its build prefix (configure --prefix), written into sysconfig, pkg-config and script shebangs.
PY_BUILD_PREFIX="$("$PY_PREFIX/bin/python3.12" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
PY_BUILD_PREFIX="${PY_BUILD_PREFIX%/lib}"
# Its identity for the recipe hash: version and build, every file's name and size (not
# site-packages or __pycache__, which change as the host uses it), the interpreter's and
# libpython's bytes.
PY_HASH="$( (cd "$PY_PREFIX" && "$PY_PREFIX/bin/python3.12" -VV \
  && find . \( -name __pycache__ -o -path ./lib/python3.12/site-packages \) -prune -o -type f -printf '%P %s\n' \
     | LC_ALL=C sort \
  && sha256sum bin/python3.12 lib/libpython3.12.so* 2>/dev/null) | sha256sum | cut -c1-12)"

stage_python() {  # <dir>: the CPython at $PY_PREFIX, trimmed like python:slim, for /usr/local
  # Left out: site-packages (ensurepip puts pip back; the host's own additions stay out), the
  # test suites, the static libpython, tkinter/idle (no Tk in the image), byte code (compiled
  # again in the image), pip and idle scripts. Debug info is stripped.
  mkdir -p "$1"
  tar -C "$PY_PREFIX" -c \
      --exclude='./lib/python3.12/site-packages/*' --exclude=test --exclude=tests \
      --exclude=idle_test --exclude=__pycache__ --exclude='libpython*.a' \
      --exclude=idlelib --exclude=tkinter --exclude=turtledemo --exclude='_tkinter.*' \
      --exclude='./bin/pip*' --exclude='./bin/idle*' --exclude='./bin/python3.12-gdb.py' . \
    | tar -C "$1" -x
  find "$1" -type f \( -name '*.so' -o -name '*.so.*' -o -name python3.12 \) -exec strip --strip-debug {} +
  # The build prefix -> /usr/local in the text files that name it (sysconfig data, Makefile,
  # python-config, pkg-config, shebangs of pydoc and 2to3).
  grep -rlI --null -F "$PY_BUILD_PREFIX" "$1" | xargs -0 -r sed -i "s|$PY_BUILD_PREFIX|/usr/local|g"
}

# Two recipe hashes: the Debian rootfs (suite, mirror, packages, import_debian) and the bases
# (that one plus this whole script minus its comment lines, plus the CPython's identity: editing a
# comment rebuilds nothing). Changing only the bases' Dockerfiles below reuses the debootstrapped image.
DEBIAN_HASH="$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "$(declare -f import_debian)" | sha256sum | cut -c1-12)"
HASH="$( (grep -v '^[[:space:]]*#' "${BASH_SOURCE[0]}"; echo "$DEBIAN_HASH"; echo "$PY_HASH") | sha256sum | cut -c1-12)"
DEBIAN_TAG="trainergroup.local/debian:$SUITE-$DEBIAN_HASH"
PYTHON_TAG="trainergroup.local/base-python:$SUITE-$HASH"
RAY_TAG="trainergroup.local/base-ray:$SUITE-$HASH"

result() { echo "debian=$DEBIAN_TAG"; echo "operator=$PYTHON_TAG"; echo "runtime=$RAY_TAG"; }

if [[ "${1:-}" == "--print" ]]; then result; exit 0; fi
if [[ "${1:-}" == "--stage" ]]; then
  [[ -n "${2:-}" ]] || { log "ERROR: --stage needs a directory: --stage DIR"; exit 2; }
  stage_python "$2"; log "staged $PY_PREFIX ($("$PY_PREFIX/bin/python3.12" -V 2>&1)) in $2 for /usr/local"; exit 0
fi
if have "$DEBIAN_TAG" && have "$PYTHON_TAG" && have "$RAY_TAG"; then log "cached: $PYTHON_TAG $RAY_TAG"; result; exit 0; fi

# One builder at a time (two test sessions starting together).
mkdir -p "${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup"
exec 8>"${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/build-bases.lock"
flock -w 1800 8 || { log "ERROR: timed out waiting for another build-bases.sh"; exit 1; }
if have "$DEBIAN_TAG" && have "$PYTHON_TAG" && have "$RAY_TAG"; then log "built meanwhile: $PYTHON_TAG $RAY_TAG"; result; exit 0; fi

T0=$SECONDS
have "$DEBIAN_TAG" || import_debian "$DEBIAN_TAG"

T1=$SECONDS
# The build context holds only the staged CPython; the rest comes from the imported Debian image.
CTX="$(mktemp -d)"; trap 'rm -rf "$CTX"' EXIT
stage_python "$CTX/python"
"$DOCKER" build -q -t "$PYTHON_TAG" --build-arg "DEBIAN=$DEBIAN_TAG" -f - "$CTX" >&2 <<'DOCKERFILE'
ARG DEBIAN
FROM ${DEBIAN}
# The official python image: CPython in /usr/local, python/pip on PATH, pip allowed outside a
# venv (no Debian python3, so no PEP 668 marker). Every library its modules link must resolve.
COPY python/ /usr/local/
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN ldconfig \
 && missing="$(find /usr/local/bin/python3.12 /usr/local/lib -type f \( -name python3.12 -o -name '*.so*' \) \
      | xargs ldd 2>/dev/null | grep 'not found' | sort -u)" \
 && if [ -n "$missing" ]; then echo "base-python: libraries not in the image (add their Debian packages to PY_LIBS): $missing" >&2; exit 1; fi \
 && python3.12 -m ensurepip --default-pip \
 && rm -rf /root/.cache \
 && python -m compileall -q -j0 /usr/local/lib/python3.12 \
 && python -c 'import sys; assert sys.version_info[:2] == (3, 12) and sys.prefix == "/usr/local", (sys.version, sys.prefix)' \
 && python -c 'import ssl, hashlib, sqlite3, ctypes, lzma, bz2, zlib, readline, uuid, decimal, curses, pyexpat, venv' \
 && python --version && pip --version && python -m venv --help >/dev/null
CMD ["python3"]
DOCKERFILE
"$DOCKER" build -q -t "$RAY_TAG" --build-arg "PYBASE=$PYTHON_TAG" -f - "$CTX" >&2 <<'DOCKERFILE'
ARG PYBASE
FROM ${PYBASE}
# rayproject/ray: user ray (1000, group users=100), home /home/ray, its Python first on PATH.
RUN useradd --uid 1000 --gid 100 --create-home --home-dir /home/ray --shell /bin/bash ray \
 && python3 -m venv /home/ray/anaconda3 \
 && mkdir -p /home/ray/.cache/pip \
 && chown -R 1000:100 /home/ray \
 && echo 'export PATH=/home/ray/anaconda3/bin:$PATH' > /etc/profile.d/00-ray-python.sh \
 && echo 'export PATH=/home/ray/anaconda3/bin:$PATH' >> /home/ray/.bashrc
ENV PATH=/home/ray/anaconda3/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/home/ray
USER 1000:100
WORKDIR /home/ray
RUN python --version | grep -q '^Python 3\.12\.' && pip --version && test -w /home/ray/anaconda3/lib \
 && bash -lc 'command -v python' | grep -q /home/ray/anaconda3 && command -v wget
CMD ["bash"]
DOCKERFILE
log "built $PYTHON_TAG and $RAY_TAG in $((SECONDS - T1)) s (total $((SECONDS - T0)) s)"
result
