#!/usr/bin/env bash
# Build the project's images here, FROM stand-in bases made from Debian's packages.
#
#   hack/images/build.sh [operator|runtime|runtime-cpu|kuberay|kueue|all]...   (default: all =
#   operator, runtime, kuberay)
#
# operator  images/operator.Dockerfile -> $OPERATOR_IMAGE (ghcr.io/trainergroup/operator:<appVersion>)
# runtime   images/runtime.Dockerfile  -> $RUNTIME_IMAGE  (ghcr.io/trainergroup/runtime:<appVersion>)
# runtime-cpu  the same, --build-arg VARIANT=cpu -> $RUNTIME_CPU_IMAGE ($RUNTIME_IMAGE-cpu): no
#           CUDA libraries (3.6 GB instead of 6.4), for CPU-only pods; the kind suite uses it
# kuberay   images/go-manager.Dockerfile with hack/build-tools.sh's ray-operator binary
#           -> $KUBERAY_IMAGE (trainergroup.local/kuberay-operator:<KUBERAY_VERSION>)
# kueue     images/go-manager.Dockerfile with hack/kueue/build.sh's manager binary
#           -> $KUEUE_IMAGE (trainergroup.local/kueue:<KUEUE_VERSION>, hack/kueue/version.env)
# The tags are the ones the chart (charts/trainergroup: values.yaml image.repository,
# Chart.yaml appVersion) and the TrainerGroup examples expect, so `kind load` + `helm install`
# need no overrides. Bases: hack/images/build-bases.sh (cached by recipe hash), or set
# OPERATOR_BASE_IMAGE / RUNTIME_BASE_IMAGE / GO_MANAGER_BASE_IMAGE (KubeRay's and Kueue's;
# KUBERAY_BASE_IMAGE still works) to use other (e.g. upstream) ones.
# pip reaches PyPI with $PIP_CA_BUNDLE (default: the host's /etc/ssl/certs/ca-certificates.crt)
# given to BuildKit as the secret `pip-ca`: mounted during the install RUN only, never stored.
# Layer and pip caches are Docker's own (BuildKit): a second run with nothing changed takes
# seconds, a changed source file rebuilds only the last layers. Prints a time per image.
# Env: DOCKER, OPERATOR_IMAGE, RUNTIME_IMAGE, KUBERAY_IMAGE, KUEUE_IMAGE, *_BASE_IMAGE,
# KUBERAY_OPERATOR_BIN, KUEUE_MANAGER_BIN,
# PIP_CA_BUNDLE (empty: no secret), TG_BUILD_CONTEXT, BUILD_FLAGS.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck disable=SC1091  # hack/versions.env: plain KEY=value lines
source "$REPO/hack/versions.env"
DOCKER="${DOCKER:-/usr/bin/docker}"   # Debian's docker.io CLI: BuildKit built in (no buildx needed)
export DOCKER_BUILDKIT=1
# TG_BUILDKIT_KEEP=14GB: BuildKit cache kept after a build (docker builder prune --keep-storage).

APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO/charts/trainergroup/Chart.yaml")"
OPERATOR_REPO="$(sed -n '/^image:/,/^[^ ]/s/^  repository: *//p' "$REPO/charts/trainergroup/values.yaml" | head -1)"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-${OPERATOR_REPO:-ghcr.io/trainergroup/operator}:$APP_VERSION}"
RUNTIME_IMAGE="${RUNTIME_IMAGE:-${OPERATOR_REPO%/operator}/runtime:$APP_VERSION}"
RUNTIME_CPU_IMAGE="${RUNTIME_CPU_IMAGE:-$RUNTIME_IMAGE-cpu}"
KUBERAY_IMAGE="${KUBERAY_IMAGE:-trainergroup.local/kuberay-operator:$KUBERAY_VERSION}"
# shellcheck disable=SC1091  # hack/kueue/version.env: KUEUE_VERSION (apart, so it keys no k8s build)
source "$REPO/hack/kueue/version.env"
KUEUE_IMAGE="${KUEUE_IMAGE:-trainergroup.local/kueue:$KUEUE_VERSION}"
PIP_CA_BUNDLE="${PIP_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}"
# The build context (default: the repository; a copy works too, e.g. to time a source change).
CONTEXT="${TG_BUILD_CONTEXT:-$REPO}"
# Extra `docker build` flags, word-split (e.g. BUILD_FLAGS=--no-cache to re-run every step).
read -r -a EXTRA <<<"${BUILD_FLAGS:-}"

log() { printf '%s build: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

"$DOCKER" info >/dev/null 2>&1 || die "no Docker engine at $DOCKER (start one: hack/docker/up.sh)"

bases() {  # sets DEBIAN_BASE / OPERATOR_BASE / RUNTIME_BASE from build-bases.sh, once
  [[ -n "${DEBIAN_BASE:-}" ]] && return 0
  local out t0=$SECONDS
  out="$("$HERE/build-bases.sh")"
  DEBIAN_BASE="$(sed -n 's/^debian=//p' <<<"$out")"
  OPERATOR_BASE="$(sed -n 's/^operator=//p' <<<"$out")"
  RUNTIME_BASE="$(sed -n 's/^runtime=//p' <<<"$out")"
  TIMES+=("bases $((SECONDS - t0)) s")
}

secret_args() {
  if [[ -n "$PIP_CA_BUNDLE" && -r "$PIP_CA_BUNDLE" ]]; then
    echo "--secret" "id=pip-ca,src=$PIP_CA_BUNDLE"
  fi
}

build_python_image() {  # <name> <dockerfile> <tag> <base> [docker build flags]
  local name="$1" dockerfile="$2" tag="$3" base="$4" t0=$SECONDS
  shift 4
  log "$name: $tag FROM $base"
  # shellcheck disable=SC2046
  "$DOCKER" build -f "$REPO/$dockerfile" -t "$tag" --build-arg "BASE_IMAGE=$base" "$@" \
    $(secret_args) ${EXTRA[@]+"${EXTRA[@]}"} "$CONTEXT" >&2
  TIMES+=("$name $((SECONDS - t0)) s ($tag)")
  log "$name: built $tag in $((SECONDS - t0)) s"
}

build_operator() {
  local base="${OPERATOR_BASE_IMAGE:-}"
  [[ -n "$base" ]] || { bases; base="$OPERATOR_BASE"; }
  build_python_image operator images/operator.Dockerfile "$OPERATOR_IMAGE" "$base"
}

build_runtime() {
  local base="${RUNTIME_BASE_IMAGE:-}"
  [[ -n "$base" ]] || { bases; base="$RUNTIME_BASE"; }
  build_python_image runtime images/runtime.Dockerfile "$RUNTIME_IMAGE" "$base"
}

build_runtime_cpu() {
  local base="${RUNTIME_BASE_IMAGE:-}"
  [[ -n "$base" ]] || { bases; base="$RUNTIME_BASE"; }
  build_python_image runtime-cpu images/runtime.Dockerfile "$RUNTIME_CPU_IMAGE" "$base" --build-arg VARIANT=cpu
}

build_go_manager() {  # <name> <tag> <version> <binary>: images/go-manager.Dockerfile
  local name="$1" tag="$2" version="$3" bin="$4" base="${GO_MANAGER_BASE_IMAGE:-${KUBERAY_BASE_IMAGE:-}}" t0=$SECONDS ctx title
  title="${tag##*/}"; title="${title%%:*}"   # the image's name: kuberay-operator, kueue
  [[ -n "$base" ]] || { bases; base="$DEBIAN_BASE"; }
  [[ -x "$bin" ]] || die "$name: no manager binary at $bin"
  ctx="$(mktemp -d)"
  # shellcheck disable=SC2064
  trap "rm -rf '$ctx'" RETURN
  ln "$bin" "$ctx/manager" 2>/dev/null || cp "$bin" "$ctx/manager"
  log "$name: $tag FROM $base ($bin)"
  "$DOCKER" build -f "$REPO/images/go-manager.Dockerfile" -t "$tag" \
    --build-arg "BASE_IMAGE=$base" --build-arg "TITLE=$title" --build-arg "VERSION=$version" "$ctx" >&2
  TIMES+=("$name $((SECONDS - t0)) s ($tag)")
  log "$name: built $tag in $((SECONDS - t0)) s"
}

build_kuberay() {
  local bin="${KUBERAY_OPERATOR_BIN:-}"
  if [[ -z "$bin" ]]; then
    # Waits on build-tools' lock when its (long, cold) build is running; prints the bin dir last.
    log "kuberay: the ray-operator binary from hack/build-tools.sh (waits for a build in progress)"
    bin="$("$REPO/hack/build-tools.sh" | tail -1)/ray-operator"
  fi
  build_go_manager kuberay "$KUBERAY_IMAGE" "$KUBERAY_VERSION" "$bin"
}

build_kueue() {
  local bin="${KUEUE_MANAGER_BIN:-}"
  if [[ -z "$bin" ]]; then
    log "kueue: the manager binary from hack/kueue/build.sh (cold: a go build of minutes)"
    bin="$("$REPO/hack/kueue/build.sh" | tail -1)"
  fi
  build_go_manager kueue "$KUEUE_IMAGE" "$KUEUE_VERSION" "$bin"
}

TIMES=()
targets=("$@"); [[ ${#targets[@]} -gt 0 ]] || targets=(all)
T0=$SECONDS
for t in "${targets[@]}"; do
  case "$t" in
    operator) build_operator ;;
    runtime) build_runtime ;;
    runtime-cpu) build_runtime_cpu ;;
    kuberay) build_kuberay ;;
    kueue) build_kueue ;;
    all) build_operator; build_runtime; build_kuberay ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) die "unknown target '$t' (operator|runtime|runtime-cpu|kuberay|kueue|all)" ;;
  esac
done
log "times: $(IFS=';'; echo "${TIMES[*]}"); total $((SECONDS - T0)) s"
# Disk: every rebuild of the runtime image leaves a multi-GB dangling image and build-cache
# record behind. Drop dangling images, and cap BuildKit's cache (the wheel cache mount and
# the newest layers are the most recently used, so they stay).
"$DOCKER" image prune -f >/dev/null 2>&1 || true
"$DOCKER" builder prune -f --keep-storage "${TG_BUILDKIT_KEEP:-14GB}" >/dev/null 2>&1 || true
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
  | grep -E "^(${OPERATOR_IMAGE}|${RUNTIME_IMAGE}|${RUNTIME_CPU_IMAGE}|${KUBERAY_IMAGE}|${KUEUE_IMAGE}) " >&2 || true
