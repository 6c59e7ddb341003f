#!/usr/bin/env bash
# Build (or reuse) a kind node image entirely on this machine: no image registry is
# reachable here, so every image is built from Debian's packages (debootstrap) and from
# Go modules. See docs/kind-cluster.md.
#
#   bash hack/kind/build-node-image.sh               # build or reuse; prints the tag last
#   bash hack/kind/build-node-image.sh --print-tags  # NODE_IMAGE=... NET_IMAGE=..., no build
#   bash hack/kind/build-node-image.sh --go-deps     # only the cached Go builds (coredns, etcd)
#
# Steps, each cached (a docker image whose tag or label carries a hash of its inputs):
#   1. Debian stand-in base: debootstrap --variant=minbase bookworm | docker import
#   2. node base, laid out like kind's base image (images/node-base/Dockerfile)
#   3. utility image (iptables, iproute2, busybox): base of kube-proxy, tg-cni, check pods
#   4. the images `kubeadm config images list` names, tagged exactly so; tg-cni's image
#   5. node image = node base + kubelet/kubeadm/kubectl + those images preloaded into the
#      node's containerd (`ctr import` in a build container, then `docker commit`, as kind
#      does) + /kind/version + /kind/manifests/{default-cni,default-storage}.yaml
# Settings: TG_K8S_TOOLS_BIN (skip hack/build-tools.sh), TG_KIND_CACHE, TG_KIND_NODE_IMAGE.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MODE="${1:-build}"
IMG="$KIND_DIR/images"
RUNC_WRAPPER="$REPO_ROOT/hack/docker/runc-dropcap"
mkdir -p "$TG_KIND_CACHE/bin"
TIMINGS="$TG_KIND_CACHE/timings.log"

[[ -d "$TG_KIND_MODULE/images/base/files" ]] || die "kind module source not found at $TG_KIND_MODULE (run: go mod download sigs.k8s.io/kind@$KIND_VERSION)"
[[ -f "$RUNC_WRAPPER" ]] || die "missing $RUNC_WRAPPER (the runc wrapper from hack/docker/)"

# ---- hashes (inputs of every step) ---------------------------------------------------------
DEBIAN_RECIPE=1   # bump when the debootstrap step below changes
KIND_FILES_SUM="$(cd "$TG_KIND_MODULE/images/base/files" && find . -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)"
H_DEBIAN="$(hash_of "suite=$DEBIAN_SUITE recipe=$DEBIAN_RECIPE")"
H_BASE="$(hash_of "$H_DEBIAN kind=$KIND_FILES_SUM" "$IMG"/node-base/* "$RUNC_WRAPPER")"
H_NET="$(hash_of "$H_DEBIAN" "$IMG"/net/*)"
# shellcheck disable=SC2046
RECIPE_HASH="$(hash_of "kind=$KIND_VERSION $KIND_FILES_SUM $DEBIAN_SUITE" "${BASH_SOURCE[0]}" "$KIND_DIR/lib.sh" \
  $(find "$IMG" -type f | LC_ALL=C sort) "$RUNC_WRAPPER" "$REPO_ROOT/hack/versions.env")"

DEBIAN_IMAGE="trainergroup.local/kind-debian:${DEBIAN_SUITE}-${H_DEBIAN}"
BASE_IMAGE="trainergroup.local/kind-base:${H_BASE}"
NET_IMAGE="trainergroup.local/kind-net:${H_NET}"
NODE_IMAGE="${TG_KIND_NODE_IMAGE:-trainergroup.local/kind-node:${KUBERNETES_VERSION}-${RECIPE_HASH}}"

if [[ "$MODE" == "--print-tags" ]]; then
  echo "NODE_IMAGE=$NODE_IMAGE"
  echo "NET_IMAGE=$NET_IMAGE"
  exit 0
fi

timing() {  # <what> <seconds> <cold|warm>
  echo "$(date -u +%FT%TZ) $1 $2s $3" >>"$TIMINGS"
  log "$1: $2s ($3)"
}

# docker build, skipped when <tag> already carries label trainergroup.recipe=<hash>.
build_image() {  # <tag> <hash> <context> <dockerfile> [docker build args...]
  local tag="$1" h="$2" ctx="$3" df="$4"; shift 4
  if [[ "$(image_label "$tag" trainergroup.recipe)" == "$h" ]]; then
    log "reuse $tag"; return 0
  fi
  log "docker build $tag"
  local t0=$SECONDS
  "$DOCKER" build -q --label "trainergroup.recipe=$h" -t "$tag" -f "$df" "$@" "$ctx" >/dev/null \
    || die "docker build of $tag failed (rerun: $DOCKER build -f $df $* $ctx)"
  timing "build $tag" $((SECONDS - t0)) cold
}

# Go binaries not in hack/build-tools.sh's set, cached by version under $TG_KIND_CACHE/bin.
go_build_cached() {  # <out name> <module> <version> <package>
  local name="$1" mod="$2" ver="$3" pkg="$4" out="$TG_KIND_CACHE/bin/$1-$3"
  if [[ -x "$out" ]]; then echo "$out"; return 0; fi
  log "go build $pkg@$ver (cached afterwards as $out)"
  local t0=$SECONDS wrap; wrap="$(mktemp -d)"
  # A wrapper module: `go install mod@ver` refuses modules whose go.mod has replace
  # directives (etcd's do); as a dependency those are ignored.
  (cd "$wrap" && go mod init tgwrap >/dev/null 2>&1 && go mod edit -require="$mod@$ver" \
    && CGO_ENABLED=0 GOFLAGS=-mod=mod nice -n 10 go build -trimpath -ldflags "-s -w" -o "$wrap/out" "$pkg") >&2 \
    || { rm -rf "$wrap"; die "go build $pkg@$ver failed (see above); is $mod@$ver on the Go proxy?"; }
  mv "$wrap/out" "$out"; rm -rf "$wrap"
  timing "go build $name $ver" $((SECONDS - t0)) cold
  echo "$out"
}

# ---- 1. Debian stand-in base ----------------------------------------------------------------
step_debian() {
  if image_exists "$DEBIAN_IMAGE"; then log "reuse $DEBIAN_IMAGE"; return 0; fi
  command -v debootstrap >/dev/null || die "debootstrap not installed (apt-get install -y debootstrap)"
  local t0=$SECONDS dir; dir="$(mktemp -d /var/tmp/tg-debootstrap.XXXXXX)"
  log "debootstrap --variant=minbase $DEBIAN_SUITE ($DEBIAN_MIRROR) into $dir"
  with_timeout 900 "debootstrap" debootstrap --variant=minbase "$DEBIAN_SUITE" "$dir" "$DEBIAN_MIRROR" \
    >"$TG_KIND_CACHE/debootstrap.log" 2>&1 \
    || { rm -rf "$dir"; die "debootstrap failed (log: $TG_KIND_CACHE/debootstrap.log)"; }
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/tmp/*
  # docker build steps run apt; keep images small
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' >"$dir/etc/apt/apt.conf.d/90tg-norecommends"
  tar -C "$dir" -c . | "$DOCKER" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$DEBIAN_IMAGE" >/dev/null \
    || { rm -rf "$dir"; die "docker import of the debootstrap tree failed"; }
  rm -rf "$dir"
  timing "debootstrap+import $DEBIAN_IMAGE" $((SECONDS - t0)) cold
}

# ---- 2. node base ---------------------------------------------------------------------------
step_base() {
  if [[ "$(image_label "$BASE_IMAGE" trainergroup.recipe)" == "$H_BASE" ]]; then log "reuse $BASE_IMAGE"; return 0; fi
  local ctx; ctx="$(mktemp -d)"
  cp -r "$TG_KIND_MODULE/images/base/files" "$ctx/files"
  chmod -R u+w "$ctx/files"
  mkdir "$ctx/tg"
  cp "$RUNC_WRAPPER" "$IMG/node-base/patch-containerd-config.sh" "$ctx/tg/"
  build_image "$BASE_IMAGE" "$H_BASE" "$ctx" "$IMG/node-base/Dockerfile" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
  rm -rf "$ctx"
}

# ---- 3./4. component images -----------------------------------------------------------------
binctx() {  # <dir> <binary...>: a build context with bin/<binaries> (hard links, no copies)
  local dir="$1"; shift; mkdir -p "$dir/bin"
  local b; for b in "$@"; do ln -f "$b" "$dir/bin/" 2>/dev/null || cp "$b" "$dir/bin/"; done
}

same_minor() { [[ "${1%.*}" == "${2%.*}" ]]; }  # v3.6.5 v3.6.4: yes

step_images() {  # fills IMAGES (all refs to preload) and CNI_IMAGE
  local bin="$1"
  local list; list="$("$bin/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION" 2>/dev/null)" \
    || die "kubeadm config images list failed ($bin/kubeadm)"
  log "kubeadm expects: $(echo $list)"
  IMAGES=()
  local ref name tag h ctx
  for ref in $list; do
    name="${ref##*/}"; name="${name%%:*}"; tag="${ref##*:}"
    ctx="$(mktemp -d)"
    case "$name" in
      kube-apiserver|kube-controller-manager|kube-scheduler)
        [[ "$tag" == "$KUBERNETES_VERSION" ]] || die "kubeadm wants $ref but build-tools built $KUBERNETES_VERSION"
        binctx "$ctx" "$bin/$name"
        h="$(hash_of "$name" "$IMG/k8s/Dockerfile" "$bin/$name")"
        build_image "$ref" "$h" "$ctx" "$IMG/k8s/Dockerfile" --build-arg "NAME=$name" ;;
      kube-proxy)
        binctx "$ctx" "$bin/kube-proxy"
        h="$(hash_of "$H_NET" "$IMG/k8s/kube-proxy.Dockerfile" "$bin/kube-proxy")"
        build_image "$ref" "$h" "$ctx" "$IMG/k8s/kube-proxy.Dockerfile" --build-arg "NET_IMAGE=$NET_IMAGE" ;;
      etcd)
        local ev="v${tag%-*}" ebin
        if same_minor "$ev" "$ETCD_VERSION"; then
          # The plane's etcd (ETCD_VERSION, compiled with Kubernetes in build-tools.sh) under
          # kubeadm's tag: one etcd build, not two (patch releases of one minor share the
          # storage format; kubeadm only names the image). Saves a ~5 min cold go build.
          ebin="$bin/etcd"
          [[ "$ev" == "$ETCD_VERSION" ]] || log "etcd: kubeadm names $ev; the node runs the plane's $ETCD_VERSION under that tag"
        else ebin="$(go_build_cached etcd go.etcd.io/etcd/server/v3 "$ev" go.etcd.io/etcd/server/v3)"; fi
        mkdir -p "$ctx/bin"; cp "$ebin" "$ctx/bin/etcd"
        h="$(hash_of "etcd $ev $(sha256sum <"$ebin")" "$IMG/k8s/Dockerfile")"
        build_image "$ref" "$h" "$ctx" "$IMG/k8s/Dockerfile" --build-arg NAME=etcd ;;
      coredns)
        local cbin; cbin="$(go_build_cached coredns github.com/coredns/coredns "$tag" github.com/coredns/coredns)"
        cp "$cbin" "$ctx/coredns"
        h="$(hash_of "$tag $(sha256sum <"$cbin")" "$IMG/coredns/Dockerfile")"
        build_image "$ref" "$h" "$ctx" "$IMG/coredns/Dockerfile" ;;
      pause)
        h="$(hash_of pause "$IMG/pause/Dockerfile" "$IMG/pause/pause.c")"
        if [[ "$(image_label "$ref" trainergroup.recipe)" != "$h" ]]; then
          gcc -static -O2 -s -o "$ctx/pause" "$IMG/pause/pause.c" || die "gcc -static pause.c failed (apt-get install -y gcc libc6-dev)"
        fi
        build_image "$ref" "$h" "$ctx" "$IMG/pause/Dockerfile"
        PAUSE_IMAGE="$ref" ;;
      *) die "kubeadm lists an image this script does not know how to build: $ref" ;;
    esac
    rm -rf "$ctx"
    IMAGES+=("$ref")
  done
  [[ -n "${PAUSE_IMAGE:-}" ]] || die "kubeadm listed no pause image"
  # our CNI daemon
  ctx="$(mktemp -d)"; binctx "$ctx" "$bin/kubectl"; cp "$IMG/tg-cni/tg-cni" "$ctx/"
  h="$(hash_of "$H_NET" "$IMG/tg-cni/Dockerfile" "$IMG/tg-cni/tg-cni" "$bin/kubectl")"
  CNI_IMAGE="trainergroup.local/tg-cni:$h"
  build_image "$CNI_IMAGE" "$h" "$ctx" "$IMG/tg-cni/Dockerfile" --build-arg "NET_IMAGE=$NET_IMAGE"
  rm -rf "$ctx"
  IMAGES+=("$CNI_IMAGE" "$NET_IMAGE")
}

# ---- 5. node image --------------------------------------------------------------------------
step_node() {
  local bin="$1" t0=$SECONDS name="tg-kind-build-$$"
  BUILD_CID=""
  cleanup_build() { [[ -z "${BUILD_CID:-}" ]] || "$DOCKER" rm -f -v "$BUILD_CID" >/dev/null 2>&1 || true; }
  trap cleanup_build EXIT
  log "assembling $NODE_IMAGE in build container $name"
  # Not privileged: containerd only stores content here (--no-unpack), nothing is mounted.
  BUILD_CID="$("$DOCKER" run -d --security-opt seccomp=unconfined --entrypoint=sleep \
          --name "$name" "$BASE_IMAGE" infinity)" || die "cannot start a build container from $BASE_IMAGE"
  local cid="$BUILD_CID"
  local x; for x in kubelet kubeadm kubectl; do
    "$DOCKER" cp "$bin/$x" "$cid:/usr/bin/$x" || die "docker cp $x failed"
  done
  local man; man="$(mktemp -d)"
  sed "s|@TG_CNI_IMAGE@|$CNI_IMAGE|" "$IMG/tg-cni/default-cni.yaml.in" >"$man/default-cni.yaml"
  cp "$IMG/default-storage.yaml" "$man/default-storage.yaml"
  "$DOCKER" exec "$cid" mkdir -p /kind/manifests
  "$DOCKER" cp "$man/default-cni.yaml" "$cid:/kind/manifests/default-cni.yaml"
  "$DOCKER" cp "$man/default-storage.yaml" "$cid:/kind/manifests/default-storage.yaml"
  rm -rf "$man"
  "$DOCKER" exec "$cid" bash -euc "
    echo -n '$KUBERNETES_VERSION' > /kind/version
    sed -i 's|sandbox_image = .*|sandbox_image = \"$PAUSE_IMAGE\"|' /etc/containerd/config.toml
    grep -q 'sandbox_image = \"$PAUSE_IMAGE\"' /etc/containerd/config.toml
    kubelet --version; kubeadm version -o short
    nohup containerd >/tmp/containerd.log 2>&1 &
    for i in \$(seq 1 60); do ctr version >/dev/null 2>&1 && exit 0; sleep 0.5; done
    cat /tmp/containerd.log; exit 1" || die "containerd did not start in the build container"
  log "preloading ${#IMAGES[@]} images: ${IMAGES[*]}"
  local ti=$SECONDS
  "$DOCKER" save "${IMAGES[@]}" | "$DOCKER" exec -i "$cid" \
      ctr --namespace=k8s.io images import --all-platforms --no-unpack --digests - >/dev/null \
    || die "ctr images import into the build container failed"
  local have; have="$("$DOCKER" exec "$cid" ctr --namespace=k8s.io images list -q)"
  local ref; for ref in "${IMAGES[@]}"; do
    grep -qx "$ref" <<<"$have" || die "image $ref missing after import (have: $have)"
    "$DOCKER" exec "$cid" ctr --namespace=k8s.io images label "$ref" io.cri-containerd.pinned=pinned >/dev/null
  done
  timing "preload images into node" $((SECONDS - ti)) cold
  "$DOCKER" exec "$cid" bash -c 'pkill containerd; for i in $(seq 1 40); do pgrep -x containerd >/dev/null || break; sleep 0.25; done
    rm -rf /tmp/* /run/containerd /var/log/* 2>/dev/null; true'
  "$DOCKER" commit \
    --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
    --change "LABEL trainergroup.recipe=$RECIPE_HASH trainergroup.kubernetes=$KUBERNETES_VERSION" \
    "$cid" "$NODE_IMAGE" >/dev/null || die "docker commit failed"
  cleanup_build; BUILD_CID=""; trap - EXIT
  timing "node image $NODE_IMAGE (assembly)" $((SECONDS - t0)) cold
}

# ---- main -----------------------------------------------------------------------------------
T0=$SECONDS
if [[ "$MODE" == "--go-deps" ]]; then
  src="$(go env GOMODCACHE)/k8s.io/kubernetes@$KUBERNETES_VERSION/cmd/kubeadm/app/constants/constants.go"
  cv="$(sed -n 's/^\s*CoreDNSVersion = "\(.*\)"/\1/p' "$src")"
  ev="$(sed -n 's/^\s*DefaultEtcdVersion = "\(.*\)-.*"/\1/p' "$src")"
  go_build_cached coredns github.com/coredns/coredns "$cv" github.com/coredns/coredns
  same_minor "v$ev" "$ETCD_VERSION" || go_build_cached etcd go.etcd.io/etcd/server/v3 "v$ev" go.etcd.io/etcd/server/v3
  exit 0
fi
if [[ "$(image_label "$NODE_IMAGE" trainergroup.recipe)" == "$RECIPE_HASH" ]]; then
  log "reuse $NODE_IMAGE (recipe $RECIPE_HASH)"
  timing "node image (all steps)" $((SECONDS - T0)) warm
  echo "$NODE_IMAGE"; exit 0
fi
step_debian
step_base
build_image "$NET_IMAGE" "$H_NET" "$IMG/net" "$IMG/net/Dockerfile" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
BIN="$(tools_bin)"
log "Kubernetes binaries from $BIN"
step_images "$BIN"
step_node "$BIN"
timing "node image (all steps)" $((SECONDS - T0)) build
echo "$NODE_IMAGE"
