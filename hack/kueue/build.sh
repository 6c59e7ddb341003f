#!/usr/bin/env bash
# Build Kueue's controller manager from its Go module (sigs.k8s.io/kueue/cmd/kueue at
# hack/kueue/version.env's KUEUE_VERSION), once per version, and print the binary's path on the
# last line. Kueue's own image (registry.k8s.io/kueue/kueue) cannot be pulled on these machines;
# hack/images/build.sh kueue packages this binary the way it packages KubeRay's.
#
#   hack/kueue/build.sh            build (or reuse) and print the binary's path
#   hack/kueue/build.sh --verify   exit 0 when the cached binary is there and intact
#
# Cache: ${TG_KUEUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/kueue}/<hash>/manager,
# <hash> over KUEUE_VERSION and `go version`/GOOS/GOARCH. The binary's sha256 is recorded when it
# is built and checked on every reuse: a truncated or changed binary is rebuilt, not trusted. It
# is built in a temporary directory and renamed into place (a half-done build is never used).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=version.env
source "$HERE/version.env"
log() { printf '%s kueue-build: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else die "no Go toolchain (set GO=/path/to/go; hack/build-tools.sh needs one too)"
  fi
fi
export GOFLAGS="-buildvcs=false" GOTOOLCHAIN=local CGO_ENABLED=0

KEY="$(printf 'kueue=%s\ngo=%s\n%s\n' "$KUEUE_VERSION" "$("$GO" env GOVERSION)" "$("$GO" env GOOS GOARCH)")"
HASH="$(printf '%s' "$KEY" | sha256sum | cut -c1-16)"
ROOT="${TG_KUEUE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/kueue}"
DEST="$ROOT/$HASH"

intact() { [[ -x "$DEST/manager" && -f "$DEST/SHA256SUMS" ]] && (cd "$DEST" && sha256sum --quiet -c SHA256SUMS >&2); }
if [[ "${1:-}" == --verify ]]; then intact; exit $?; fi

mkdir -p "$ROOT"
exec 9>"$ROOT/.lock"
flock -w 3600 9 || die "another Kueue build held $ROOT/.lock for an hour"
if intact; then
  echo "$DEST/manager"
  exit 0
fi
[[ -d "$DEST" ]] && { log "cached $DEST fails its checksum: rebuilding it"; rm -rf "$DEST"; }
TMP="$(mktemp -d "$ROOT/.build-$HASH.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
t0=$SECONDS
log "go install sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION with $("$GO" env GOVERSION) (cold: minutes)"
GOBIN="$TMP" "$GO" install -ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
  "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION" \
  || die "building Kueue $KUEUE_VERSION failed (see above); check KUEUE_VERSION and Go proxy access"
mv "$TMP/kueue" "$TMP/manager"
(cd "$TMP" && sha256sum manager > SHA256SUMS)
printf '%s\n' "$KEY" > "$TMP/BUILD_INFO"
mv -T "$TMP" "$DEST"
trap - EXIT
log "built $DEST/manager in $((SECONDS - t0)) s"
echo "$DEST/manager"
