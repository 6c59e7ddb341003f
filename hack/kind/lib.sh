# Shared helpers for hack/kind/*.sh (sourced, not run).
# shellcheck shell=bash
KIND_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$KIND_DIR/../.." && pwd)"
# shellcheck disable=SC1091
source "$REPO_ROOT/hack/versions.env"

# Docker 20.10's CLI (BuildKit built in). /usr/local/bin/docker (28) has no buildx.
DOCKER="${TG_DOCKER:-/usr/bin/docker}"
export DOCKER_BUILDKIT=1
# kind calls plain `docker`: make sure it finds the same CLI.
export PATH="$(dirname "$DOCKER"):$PATH"

TG_KIND_CACHE="${TG_KIND_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/kind}"
TG_KIND_MODULE="${TG_KIND_MODULE:-$(go env GOMODCACHE 2>/dev/null || echo "$HOME/go/pkg/mod")/sigs.k8s.io/kind@${KIND_VERSION}}"
DEBIAN_SUITE="${TG_DEBIAN_SUITE:-bookworm}"
DEBIAN_MIRROR="${TG_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

ts() { date -u +%H:%M:%S; }
log() { echo "[$(ts)] [kind] $*" >&2; }
die() { echo "[$(ts)] [kind] ERROR: $*" >&2; exit 1; }

# sha256 (first 12 hex) of a string and the given files' names and contents.
hash_of() {  # <extra string> [file...]
  local extra="$1"; shift
  # names: repo-relative, or just the base name outside the repo (binaries in a cache dir)
  { echo "$extra"; local f n; for f in "$@"; do
      n="${f#"$REPO_ROOT"/}"; [[ "$n" != /* ]] || n="${f##*/}"; echo "== $n"; cat "$f"; done; } | sha256sum | cut -c1-12
}

image_exists() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }
image_label() { "$DOCKER" image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true; }

# Run "$@" with a deadline; on expiry die with $what.
with_timeout() {  # <seconds> <what> cmd...
  local secs="$1" what="$2"; shift 2
  timeout "$secs" "$@" || { local rc=$?; [[ $rc == 124 ]] && die "$what: timed out after ${secs}s"; return $rc; }
}

# The build-tools bin dir (waits for a running hack/build-tools.sh: it holds a lock).
tools_bin() {
  if [[ -n "${TG_K8S_TOOLS_BIN:-}" ]]; then
    [[ -x "$TG_K8S_TOOLS_BIN/kubeadm" ]] || die "TG_K8S_TOOLS_BIN=$TG_K8S_TOOLS_BIN has no kubeadm"
    echo "$TG_K8S_TOOLS_BIN"; return
  fi
  local out
  out="$(bash "$REPO_ROOT/hack/build-tools.sh" 2>>"${TG_KIND_CACHE}/build-tools.log" | tail -n1)" \
    || die "hack/build-tools.sh failed (log: ${TG_KIND_CACHE}/build-tools.log); run it alone and fix it first"
  [[ -x "$out/kubeadm" && -x "$out/kind" ]] || die "build-tools printed '$out', which has no kubeadm/kind; run 'bash hack/build-tools.sh' and check its last line"
  echo "$out"
}
