#!/usr/bin/env bash
# Load local docker images into the kind cluster's nodes (nothing can be pulled here, so
# every image a pod uses must be loaded). Pods must use imagePullPolicy: IfNotPresent/Never.
#
#   bash hack/kind/load-image.sh IMAGE...                                   # all nodes
#   TG_KIND_LOAD_NODES=tg-kind-worker,tg-kind-worker2 bash hack/kind/load-image.sh IMAGE...
#
# What it does per node, one node at a time (what `kind load docker-image` does, minus its
# temporary tar file of the whole image on the host):
#   docker save IMAGE | docker exec -i NODE ctr -n k8s.io images import --all-platforms \
#       --digests --snapshotter=overlayfs -
# then deletes the image's layer blobs from the node's content store: they are already
# unpacked into snapshots, which is all a container needs (containerd's own
# discard_unpacked_layers does the same for pulled images). Without that a node holds every
# layer twice: a 6 GB image costs 13 GB of disk per node instead of 6.5.
# Nodes that already hold the same image ID are skipped. A node that holds an older image of the
# same name gets only the layers from the first one that differs up (hack/kind/image_delta.py;
# TG_KIND_LOAD_DELTA=0 loads the whole image, as does any failure of the delta), so a code
# change costs its small top layers, not the whole image per node.
#
# Env: TG_KIND_CLUSTER (default tg-kind), TG_KIND_LOAD_NODES (comma list; default all nodes),
#      TG_KIND_LOAD_KEEP_LAYERS=1 (keep the layer blobs), TG_KIND_LOAD_VIA_KIND=1 (plain
#      `kind load docker-image` instead), TG_KIND_LOAD_TIMEOUT (seconds per node, default 1800).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DELTA_PY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/image_delta.py"
CLUSTER="${TG_KIND_CLUSTER:-tg-kind}"
TMO="${TG_KIND_LOAD_TIMEOUT:-1800}"
[[ $# -ge 1 ]] || die "usage: $0 IMAGE... (env TG_KIND_CLUSTER=$CLUSTER, TG_KIND_LOAD_NODES=n1,n2)"
BIN="$(tools_bin)"
"$BIN/kind" get clusters 2>/dev/null | grep -qx "$CLUSTER" \
  || die "no kind cluster $CLUSTER: run 'bash hack/kind/cluster.sh up' first"
if [[ -n "${TG_KIND_LOAD_NODES:-}" ]]; then
  IFS=, read -r -a NODES <<<"$TG_KIND_LOAD_NODES"
else
  mapfile -t NODES < <("$BIN/kind" get nodes --name "$CLUSTER")
fi
[[ ${#NODES[@]} -gt 0 ]] || die "cluster $CLUSTER has no nodes"

node_image_id() {  # <node> <ref>: the config digest (= docker image ID) the node holds for ref
  "$DOCKER" exec "$1" sh -c '
    m=$(ctr -n k8s.io images ls 2>/dev/null | awk -v r="$0" "\$1==r {print \$3}")
    [ -n "$m" ] && ctr -n k8s.io content get "$m" | jq -r .config.digest' "$2" 2>/dev/null || true
}

node_layers() {  # <node> <ref>: the layer digests of the image the node holds under ref (none: empty)
  "$DOCKER" exec "$1" sh -c '
    m=$(ctr -n k8s.io images ls 2>/dev/null | awk -v r="$0" "\$1==r {print \$3}")
    [ -n "$m" ] && ctr -n k8s.io content get "$m" | jq -r ".layers[].digest"' "$2" 2>/dev/null || true
}
delta_took() {  # <node> <ref> <id>: after a delta import the node lists the image under its
  # ID, unpacked (`ctr images check`'s last column), so a container can start from its snapshots
  local got unpacked
  got="$(node_image_id "$1" "$2")"
  unpacked="$("$DOCKER" exec "$1" ctr -n k8s.io images check 2>/dev/null \
    | awk -v r="$2" '$1 == r {print $NF}')"
  [[ "$got" == "$3" && "$unpacked" == true ]] && return 0
  log "after the delta import $1 lists $2 as '${got:-none}' (unpacked: '${unpacked:-?}'), expected $3 unpacked: loading it whole"
  return 1
}
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tg-load.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# A changed image whose lower layers the node already has (the usual case: a code change in
# the runtime image): an OCI archive of the layers from the first changed one up
# (hack/kind/image_delta.py), made once per image and set of layers the node has. The old
# image stays tagged during the import, so its snapshots (the new image's lower layers) are
# referenced until the new one is unpacked. Any failure: the whole image, as before.
import_delta() {  # <node> <ref> <have file>
  local n="$1" img="$2" have="$3" key delta
  key="$(sha256sum < "$have" | cut -c1-16)"
  delta="$WORK/delta.$key.tar"
  if [[ ! -f "$delta" ]]; then
    with_timeout "$TMO" "docker save $img for a delta" bash -c '
        set -o pipefail
        "$1" save "$2" | python3 "$3" --have "$4" --out "$5"' _ "$DOCKER" "$img" \
        "$DELTA_PY" "$have" "$delta.part" \
      && mv "$delta.part" "$delta" || { log "delta of $img failed: loading it whole"; return 1; }
  fi
  log "loading the layers of $img from the first that $n lacks up ($(( $(stat -c %s "$delta") >> 20 )) MiB of $mib MiB)"
  "$DOCKER" exec "$n" ctr -n k8s.io images tag --force "$img" "$img-tg-previous" >/dev/null 2>&1 || true
  if ! with_timeout "$TMO" "importing the delta of $img into $n" bash -c '
      "$1" exec -i "$2" ctr --namespace=k8s.io images import --all-platforms --digests \
          --snapshotter=overlayfs - < "$3" >/dev/null' _ "$DOCKER" "$n" "$delta"; then
    log "delta import of $img into $n failed: loading it whole"
    "$DOCKER" exec "$n" ctr -n k8s.io images rm "$img-tg-previous" >/dev/null 2>&1 || true
    return 1
  fi
  "$DOCKER" exec "$n" ctr -n k8s.io images rm "$img-tg-previous" >/dev/null 2>&1 || true
}

for img in "$@"; do
  image_exists "$img" || die "image $img is not in the local docker engine (build it first)"
  id="$("$DOCKER" image inspect -f '{{.Id}}' "$img")"
  size="$("$DOCKER" image inspect -f '{{.Size}}' "$img")"
  mib=$((size / 1024 / 1024))
  t0=$SECONDS
  if [[ "${TG_KIND_LOAD_VIA_KIND:-0}" == 1 ]]; then
    log "kind load docker-image $img ($mib MiB) into ${NODES[*]}"
    with_timeout "$TMO" "kind load docker-image $img" "$BIN/kind" load docker-image --name "$CLUSTER" \
        --nodes "$(IFS=,; echo "${NODES[*]}")" "$img" >&2 \
      || die "kind load docker-image $img failed (disk space? 'df -h /var/lib/docker')"
  else
    for n in "${NODES[@]}"; do
      id="$("$DOCKER" image inspect -f '{{.Id}}' "$img")"   # again: others may rebuild it meanwhile
      if [[ "$(node_image_id "$n" "$img")" == "$id" ]]; then
        log "$n already has $img ($id), skipped"; continue
      fi
      tn=$SECONDS
      have="$WORK/have.$n"
      node_layers "$n" "$img" > "$have"
      if [[ "${TG_KIND_LOAD_DELTA:-1}" == 1 && -s "$have" ]] && import_delta "$n" "$img" "$have" \
          && delta_took "$n" "$img" "$id"; then
        :
      else
        log "loading $img ($mib MiB) into $n"
        with_timeout "$TMO" "loading $img into $n" bash -c '
            set -o pipefail
            "$1" save "$2" | "$1" exec -i "$3" ctr --namespace=k8s.io images import \
                --all-platforms --digests --snapshotter=overlayfs - >/dev/null' _ "$DOCKER" "$img" "$n" \
          || die "importing $img into $n failed (disk space? 'df -h /var/lib/docker'; a node needs about the image size free, twice with TG_KIND_LOAD_KEEP_LAYERS=1)"
      fi
      got="$(node_image_id "$n" "$img")"
      if [[ "$got" != "$id" ]]; then
        now="$("$DOCKER" image inspect -f '{{.Id}}' "$img")"
        [[ "$now" != "$id" && "$got" == "$now" ]] \
          && log "note: $img was rebuilt while loading; $n has the new ID $now" \
          || die "$n lists $img with ID '${got:-none}', expected $id, after the import"
      fi
      if [[ "${TG_KIND_LOAD_KEEP_LAYERS:-0}" != 1 ]]; then
        "$DOCKER" exec "$n" sh -c '
          m=$(ctr -n k8s.io images ls | awk -v r="$0" "\$1==r {print \$3}")
          for d in $(ctr -n k8s.io content get "$m" | jq -r ".layers[].digest"); do
            ctr -n k8s.io content rm "$d" >/dev/null 2>&1 || true
          done' "$img" || log "warning: could not drop the layer blobs of $img on $n (disk use doubles)"
      fi
      log "$n: $img loaded in $((SECONDS - tn))s"
    done
  fi
  dt=$((SECONDS - t0))
  log "loaded $img ($mib MiB) into ${NODES[*]} in ${dt}s"
  echo "$(date -u +%FT%TZ) load $img ${mib}MiB nodes=${NODES[*]} ${dt}s" >>"$TG_KIND_CACHE/timings.log"
done
