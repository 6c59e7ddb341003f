#!/usr/bin/env bash
# Load local docker images into the kind cluster's nodes (wraps `kind load docker-image`;
# nothing can be pulled here, so every image a pod uses must be loaded this way).
#
#   bash hack/kind/load-image.sh IMAGE...            # all nodes
#   TG_KIND_LOAD_NODES=tg-kind-worker bash hack/kind/load-image.sh IMAGE...   # some nodes
#
# Pods must use imagePullPolicy: IfNotPresent or Never. kind skips nodes that already have
# the same image ID. Prints the seconds taken and the image size.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER="${TG_KIND_CLUSTER:-tg-kind}"
[[ $# -ge 1 ]] || die "usage: $0 IMAGE... (env TG_KIND_CLUSTER=$CLUSTER, TG_KIND_LOAD_NODES=n1,n2)"
BIN="$(tools_bin)"
"$BIN/kind" get clusters 2>/dev/null | grep -qx "$CLUSTER" \
  || die "no kind cluster $CLUSTER: run 'bash hack/kind/cluster.sh up' first"
args=(--name "$CLUSTER")
[[ -z "${TG_KIND_LOAD_NODES:-}" ]] || args+=(--nodes "$TG_KIND_LOAD_NODES")
for img in "$@"; do
  image_exists "$img" || die "image $img is not in the local docker engine (build it first)"
  size="$("$DOCKER" image inspect -f '{{.Size}}' "$img")"
  t0=$SECONDS
  log "kind load docker-image $img ($((size / 1024 / 1024)) MiB) into ${TG_KIND_LOAD_NODES:-all nodes of $CLUSTER}"
  with_timeout "${TG_KIND_LOAD_TIMEOUT:-1800}" "kind load docker-image $img" \
    "$BIN/kind" load docker-image "${args[@]}" "$img" >&2 \
    || die "kind load docker-image $img failed (is there disk space in /var/lib/docker? 'docker system df')"
  dt=$((SECONDS - t0))
  log "loaded $img in ${dt}s"
  echo "$(date -u +%FT%TZ) kind load $img $((size / 1024 / 1024))MiB ${dt}s" >>"$TG_KIND_CACHE/timings.log"
done
