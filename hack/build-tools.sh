#!/usr/bin/env bash
# Build the local Kubernetes control plane's binaries from Go modules, once per version set.
#
#   hack/build-tools.sh            build (or reuse) and print the bin dir on the last line
#   hack/build-tools.sh --print    print the bin dir the current versions map to; build nothing
#   hack/build-tools.sh --verify   exit 0 when that set is complete and intact; build nothing
#
# Output: ${TG_K8S_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/k8s-tools}/<hash>/bin
# holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet,
# kubeadm, kube-proxy (the last three for the kind node image, hack/kind/), kwok, ray-operator,
# helm, kind and kube-router (the kind suite's NetworkPolicy enforcer, hack/kind/netpol.sh);
# <hash>/assets holds the KubeRay CRDs and kwok's stage config. <hash> covers hack/versions.env's values and `go version`, so a version
# bump builds a new set and an unchanged one is reused. <hash>/SHA256SUMS records every binary's
# checksum when the set is built; a reuse checks them (3 s), and a set that fails the check (a
# truncated or overwritten binary) is rebuilt, never trusted. The set is built in a temporary
# directory and renamed into place, so a half-finished build is never mistaken for a done one.
#
# Only a Go toolchain is needed (GO=/path/to/go, else `go` on PATH, else /usr/local/go/bin/go)
# and network access to the Go module proxy (first build only).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

log() { printf '%s build-tools: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else die "no Go toolchain found: install Go >= 1.26 (https://go.dev/dl/) or set GO=/path/to/go"
  fi
fi

# Module-mode builds from the proxy; never switch toolchains behind our back.
export GOFLAGS="-mod=mod -buildvcs=false"
export GOTOOLCHAIN=local
export CGO_ENABLED=0

GO_VERSION="$("$GO" env GOVERSION)"
CACHE_ROOT="${TG_K8S_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainergroup/k8s-tools}"
KEY_INPUT="$(grep -E '^[A-Z_]+=' "$HERE/versions.env" | sort; echo "go=$GO_VERSION"; "$GO" env GOOS GOARCH)"
HASH="$(printf '%s\n' "$KEY_INPUT" | sha256sum | cut -c1-16)"
DEST="$CACHE_ROOT/$HASH"
BIN="$DEST/bin"
TOOLS=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kubeadm kube-proxy kwok ray-operator helm kind kube-router)

if [[ "${1:-}" == "--print" ]]; then
  echo "$BIN"
  exit 0
fi

present() {
  local t
  for t in "${TOOLS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done
  [[ -f "$DEST/BUILD_INFO" ]]
}
record_sums() {  # <dest>: the checksums a later reuse verifies
  (cd "$1/bin" && sha256sum "${TOOLS[@]}") > "$1/SHA256SUMS.tmp" && mv "$1/SHA256SUMS.tmp" "$1/SHA256SUMS"
}
intact() {  # every binary matches SHA256SUMS (quiet; lists the bad ones on stderr)
  [[ -f "$DEST/SHA256SUMS" ]] || return 1
  (cd "$BIN" && sha256sum --quiet -c "$DEST/SHA256SUMS" >&2)
}
complete() {
  present || return 1
  if [[ ! -f "$DEST/SHA256SUMS" ]]; then
    # A set built before checksums were recorded: record them once (it was complete).
    record_sums "$DEST" && log "recorded checksums for $DEST (built before SHA256SUMS existed)"
  fi
  if ! intact; then
    log "cached set $DEST fails its checksums (truncated or changed binary): rebuilding it"
    return 1
  fi
}

if [[ "${1:-}" == "--verify" ]]; then
  complete
  exit $?
fi

# ---- Assets: KubeRay CRDs and kwok's stages, from the same module versions. ------------------
# Cheap (module cache + cp); checked and refreshed on every run, independently of the binaries.
module_dir() {  # <module@version> -> its directory in the module cache
  (cd "${TMPDIR:-/tmp}" && "$GO" mod download -json "$1") | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'
}
# One writer at a time per cache root (two pytest sessions starting together, say).
LOCKED=0
lock() {
  (( LOCKED )) && return 0
  mkdir -p "$CACHE_ROOT"
  exec 9>"$CACHE_ROOT/.lock"
  if ! flock -w 5400 9; then
    die "timed out after 90 min waiting for another build to release $CACHE_ROOT/.lock"
  fi
  LOCKED=1
}

ensure_assets() {  # <dest dir>
  local dest="$1" stage kuberay kwok tmp
  [[ -f "$dest/assets/ASSETS_OK" ]] && return 0
  lock
  [[ -f "$dest/assets/ASSETS_OK" ]] && return 0
  rm -rf "$dest"/.assets.*   # left by an interrupted run (we hold the lock)
  kuberay="$(module_dir "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION")"
  kwok="$(module_dir "sigs.k8s.io/kwok@$KWOK_VERSION")"
  [[ -d "$kuberay/config/crd/bases" ]] || die "KubeRay CRDs not found under '$kuberay/config/crd/bases'; check KUBERAY_VERSION and Go proxy access"
  [[ -d "$kwok/kustomize/stage" ]] || die "kwok stages not found under '$kwok/kustomize/stage'; check KWOK_VERSION and Go proxy access"
  tmp="$(mktemp -d "$dest/.assets.XXXXXX")"
  mkdir -p "$tmp/crds/kuberay" "$tmp/kwok"
  cp "$kuberay"/config/crd/bases/*.yaml "$tmp/crds/kuberay/"
  # kwok run standalone needs its Stages in its config: the "fast" set kwokctl uses
  # (node initialize, node heartbeat with lease, pod ready/complete/delete).
  for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
               pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
    [[ -f "$kwok/kustomize/stage/$stage.yaml" ]] || die "kwok stage $stage.yaml missing in $kwok; has its layout changed?"
    { echo "---"; cat "$kwok/kustomize/stage/$stage.yaml"; } >> "$tmp/kwok/stages.yaml"
  done
  chmod -R u+w "$tmp"
  touch "$tmp/ASSETS_OK"
  rm -rf "$dest/assets"
  mv -T "$tmp" "$dest/assets"
  log "assets ready: $dest/assets (KubeRay CRDs, kwok stages)"
}

if complete; then
  ensure_assets "$DEST"
  log "up to date: $BIN (delete $DEST to force a rebuild)"
  echo "$BIN"
  exit 0
fi

lock
if complete; then
  ensure_assets "$DEST"
  log "built by another process meanwhile: $BIN"
  echo "$BIN"
  exit 0
fi

rm -rf "$CACHE_ROOT"/.build-*   # left by an interrupted build (we hold the lock)
TMP="$(mktemp -d "$CACHE_ROOT/.build-$HASH.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/bin" "$TMP/src"
START=$(date +%s)
log "building into $TMP (final: $DEST) with $GO_VERSION, $(nproc) CPUs"

# Every binary is stripped of symbol tables and DWARF (-s -w): smaller and faster to link.
LDSTRIP="-s -w"

# ---- 1. Kubernetes, etcd, KubeRay, Helm, kind, kube-router: one wrapper module, one `go build`.
# k8s.io/kubernetes replaces its staging modules (k8s.io/api, ...) with ./staging/... paths,
# which `go install mod@version` refuses. The wrapper requires k8s.io/kubernetes and replaces
# each staging module with its published release v0.<minor>.<patch>. The other tools join the
# same module, so their shared dependencies (client-go, api, apimachinery, grpc, protobuf, ...)
# resolve to one version each and compile once: built apart, each tool compiled its own copy of
# the Kubernetes client stack at its own version (issue 34; the figures are in docs/testing.md).
# The tools that join must build against this Kubernetes minor's client stack; two do not and
# stay apart: kwok (v0.8 needs client-go 0.36, v0.7 a constant 0.34 removed) and coredns (v1.12
# sets a cache.Config field 0.34 removed; built with the node image, hack/kind/).
K8S_MINOR_PATCH="${KUBERNETES_VERSION#v1.}"           # 34.4
STAGING_VERSION="v0.${K8S_MINOR_PATCH}"               # v0.34.4
K8S_MAJOR=1
K8S_MINOR="${K8S_MINOR_PATCH%%.*}"                    # 34
WRAP="$TMP/src/kubernetes"
mkdir -p "$WRAP"
log "fetching k8s.io/kubernetes@$KUBERNETES_VERSION go.mod"
K8S_MOD_JSON="$(cd "$TMP" && "$GO" mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION")" \
  || die "could not download k8s.io/kubernetes@$KUBERNETES_VERSION: check KUBERNETES_VERSION in hack/versions.env and access to the Go proxy ($("$GO" env GOPROXY))"
K8S_GOMOD="$(printf '%s' "$K8S_MOD_JSON" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
[[ -f "$K8S_GOMOD" ]] || die "no go.mod for k8s.io/kubernetes@$KUBERNETES_VERSION in the module cache"
mapfile -t STAGING < <(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "$K8S_GOMOD")
(( ${#STAGING[@]} > 10 )) || die "found only ${#STAGING[@]} staging modules in $K8S_GOMOD; has its layout changed?"
{
  echo "module trainergroup.local/k8stools"
  echo
  echo "go $(sed -n 's/^go \([0-9.]*\)$/\1/p' "$K8S_GOMOD")"
  echo
  echo "require ("
  echo "	k8s.io/kubernetes $KUBERNETES_VERSION"
  echo "	go.etcd.io/etcd/server/v3 $ETCD_VERSION"
  echo "	github.com/ray-project/kuberay/ray-operator $KUBERAY_VERSION"
  echo "	helm.sh/helm/v3 $HELM_VERSION"
  echo "	sigs.k8s.io/kind $KIND_VERSION"
  echo "	github.com/cloudnativelabs/kube-router/v2 $KUBE_ROUTER_VERSION"
  echo ")"
  echo
  echo "replace ("
  for m in "${STAGING[@]}"; do echo "	$m => $m $STAGING_VERSION"; done
  # The rest resolves by Go's minimum version selection: where a tool needs a newer shared
  # dependency than Kubernetes' go.mod says (Helm v3.19 needs pflag's ParseErrorsAllowlist,
  # 1.0.7 against Kubernetes' 1.0.6), Kubernetes builds with the newer one, as any program that
  # imports its libraries does. Pinning every requirement at Kubernetes' versions was tried and
  # fails Helm's build. The plane and kind phases test the binaries built this way.
  echo ")"
} > "$WRAP/go.mod"
log "wrapper module: ${#STAGING[@]} staging modules pinned to $STAGING_VERSION"

BUILD_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
K8S_COMMIT="$(printf '%s' "$K8S_MOD_JSON" | sed -n 's/^[[:space:]]*"Hash": "\([0-9a-f]\{40\}\)",*$/\1/p' | head -n1)"
# One -ldflags for the one build: -X of a package a binary does not link is ignored.
LDFLAGS="$LDSTRIP -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $pkg.gitVersion=$KUBERNETES_VERSION"
  LDFLAGS+=" -X $pkg.gitMajor=$K8S_MAJOR -X $pkg.gitMinor=$K8S_MINOR"
  LDFLAGS+=" -X $pkg.gitCommit=${K8S_COMMIT:-unknown} -X $pkg.gitTreeState=clean"
  LDFLAGS+=" -X $pkg.buildDate=$BUILD_DATE"
done

# No `go mod tidy`: the wrapper has no Go files, so tidy would drop every requirement.
# `go build -mod=mod` adds what the built packages need to go.mod/go.sum itself.
T0=$(date +%s)
log "go build kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kubeadm kube-proxy etcd ray-operator helm kind kube-router (one invocation; the slow part)"
(cd "$WRAP" && "$GO" build -trimpath -ldflags "$LDFLAGS" -o "$TMP/bin/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/cmd/kubelet \
  k8s.io/kubernetes/cmd/kubeadm \
  k8s.io/kubernetes/cmd/kube-proxy \
  go.etcd.io/etcd/server/v3 \
  github.com/ray-project/kuberay/ray-operator \
  helm.sh/helm/v3/cmd/helm \
  sigs.k8s.io/kind \
  github.com/cloudnativelabs/kube-router/v2/cmd/kube-router) \
  || die "building the Kubernetes tool set failed (see the compiler output above); check the versions in hack/versions.env (each tool in this build must compile against Kubernetes $STAGING_VERSION's client libraries) and that $GO_VERSION is new enough"
# A main package whose path ends in a major-version suffix (/server/v3) is named after the
# element before it.
mv "$TMP/bin/server" "$TMP/bin/etcd"
log "kubernetes, etcd, ray-operator, helm, kind, kube-router built in $(( $(date +%s) - T0 ))s"

# ---- 2. kwok: plain `go install mod@version` (its client stack is newer; see above). -------
gobin_install() {  # <binary name> <package@version> [extra ldflags]
  local name="$1" pkg="$2" extra="${3:-}" t0
  t0=$(date +%s)
  log "go install $pkg"
  GOBIN="$TMP/bin" "$GO" install -trimpath -ldflags "$LDSTRIP $extra" "$pkg" \
    || die "go install $pkg failed (see above); check the version in hack/versions.env"
  [[ -x "$TMP/bin/$name" ]] || die "go install $pkg did not produce $name"
  log "$name built in $(( $(date +%s) - t0 ))s"
}
gobin_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" \
  "-X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION"

ELAPSED=$(( $(date +%s) - START ))
{
  echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(nproc) CPUs, in ${ELAPSED}s"
  echo "$KEY_INPUT"
} > "$TMP/BUILD_INFO"

rm -rf "$TMP/src"
record_sums "$TMP"
if [[ -d "$DEST" ]]; then rm -rf "$DEST"; fi   # an incomplete earlier attempt
mv -T "$TMP" "$DEST"
trap - EXIT
ensure_assets "$DEST"
log "done in ${ELAPSED}s ($(( ELAPSED / 60 )) min): $BIN"
echo "$BIN"
