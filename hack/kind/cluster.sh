#!/usr/bin/env bash
# A 3-node kind cluster from the node image built here (hack/kind/build-node-image.sh).
#
#   bash hack/kind/cluster.sh up       # create, or reuse if healthy; prints the kubeconfig path last
#   bash hack/kind/cluster.sh status   # nodes, GPU capacity, kube-system pods; rc 0 iff healthy
#   bash hack/kind/cluster.sh check    # = hack/kind/check.sh (pod-to-pod across nodes, DNS, Service)
#   bash hack/kind/cluster.sh down     # delete the cluster
#
# Nodes: <name>-control-plane; <name>-worker, the "GPU" worker (label
# nvidia.com/gpu.present=true, taint nvidia.com/gpu=present:NoSchedule, `nvidia.com/gpu: 8`
# in its status); <name>-worker2, the CPU worker. Both workers carry
# trainergroup.local/pool=gpu|cpu.
#
# Settings (env):
#   TG_KIND_CLUSTER     cluster name (default tg-kind)
#   TG_KIND_KUBECONFIG  kubeconfig written by `up` (default ~/.cache/trainergroup/kind/<name>.kubeconfig)
#   TG_KIND_GPUS        nvidia.com/gpu count advertised by the GPU worker (default 8)
#   TG_KIND_NODE_IMAGE  use this node image instead of building/reusing ours
#   TG_KIND_TIMEOUT     seconds for each wait (default 300)
#   TG_KIND_RECREATE=1  recreate a cluster that runs an older node image (default: reuse it)
#   TG_KIND_KUBELET_SYNC kubelet syncFrequency on every node (default 10s; kubeadm's is 1m): how
#                       soon a changed Secret or ConfigMap reaches the pods that mount it
#   TG_KIND_GPU=1       real NVIDIA hosts: NOT IMPLEMENTED (TODO hook, see docs/kind-cluster.md)
#   TG_KIND_SHARED_DIR  the host directory both workers mount at /var/lib/tg-shared (default
#                       ~/.cache/trainergroup/kind/shared/<name>; emptied when a cluster is
#                       created): the one tree every worker node sees, on which the e2e suite's
#                       ReadWriteMany checkpoint volumes live (tests/e2e/lib/shared_claim.py)
#   TG_KIND_KEEP_STORES=1 (default) the two workers' containerd stores live on the host, under
#                       ~/.cache/trainergroup/kind/stores/<name>/<node>, so an image loaded
#                       once (the 6 GB runtime image) is still there in the next cluster of that
#                       name; 0: kind's throw-away /var volume (docs/testing.md)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER="${TG_KIND_CLUSTER:-tg-kind}"
KUBECONFIG_OUT="${TG_KIND_KUBECONFIG:-$TG_KIND_CACHE/$CLUSTER.kubeconfig}"
GPUS="${TG_KIND_GPUS:-8}"
WAIT="${TG_KIND_TIMEOUT:-300}"
GPU_NODE="$CLUSTER-worker"
CPU_NODE="$CLUSTER-worker2"
CP_NODE="$CLUSTER-control-plane"
mkdir -p "$TG_KIND_CACHE"
KEEP_STORES="${TG_KIND_KEEP_STORES:-1}"
STORES="$TG_KIND_CACHE/stores/$CLUSTER"
SHARED_DIR="${TG_KIND_SHARED_DIR:-$TG_KIND_CACHE/shared/$CLUSTER}"
SHARED_MOUNT=/var/lib/tg-shared

tools() {
  BIN="$(tools_bin)"
  KIND="$BIN/kind"; KUBECTL="$BIN/kubectl"
}
k() { "$KUBECTL" --kubeconfig "$KUBECONFIG_OUT" --request-timeout=30s "$@"; }

cluster_exists() { "$KIND" get clusters 2>/dev/null | grep -qx "$CLUSTER"; }

diag() {  # print what explains a failure
  echo "------ diagnostics for kind cluster $CLUSTER ------" >&2
  "$DOCKER" ps -a --filter "label=io.x-k8s.kind.cluster=$CLUSTER" --format '{{.Names}} {{.Status}} {{.Image}}' >&2 || true
  if [[ -f "$KUBECONFIG_OUT" ]]; then
    k get nodes -o wide >&2 || true
    k get pods -A -o wide >&2 || true
    k get events -A --sort-by=.lastTimestamp 2>/dev/null | tail -25 >&2 || true
  fi
  local n; for n in $("$DOCKER" ps --filter "label=io.x-k8s.kind.cluster=$CLUSTER" --format '{{.Names}}'); do
    echo "--- $n: kubelet (last 15 lines) ---" >&2
    "$DOCKER" exec "$n" journalctl -u kubelet --no-pager -n 15 >&2 2>/dev/null || true
    echo "--- $n: containerd (last 8 lines) ---" >&2
    "$DOCKER" exec "$n" journalctl -u containerd --no-pager -n 8 >&2 2>/dev/null || true
  done
  echo "------ end of diagnostics ------" >&2
}
fail() { diag; die "$*"; }

healthy() {  # quiet check: rc 0 iff the cluster answers and every node is Ready
  [[ -f "$KUBECONFIG_OUT" ]] || return 1
  k get --raw /readyz >/dev/null 2>&1 || return 1
  local nodes; nodes="$(k get nodes --no-headers 2>/dev/null)" || return 1
  [[ "$(wc -l <<<"$nodes")" -eq 3 ]] || return 1
  ! grep -vq ' Ready ' <<<"$nodes"
}

kind_config() {
  cat <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  # tg-cni is the default CNI shipped in the node image (/kind/manifests/default-cni.yaml);
  # kind installs it right after kubeadm init.
  disableDefaultCNI: false
nodes:
  - role: control-plane
  - role: worker
    labels:
      nvidia.com/gpu.present: "true"
      trainergroup.local/pool: gpu
$(node_mounts worker)
    kubeadmConfigPatches:
      - |
        kind: JoinConfiguration
        nodeRegistration:
          taints:
            - key: nvidia.com/gpu
              value: present
              effect: NoSchedule
  - role: worker
    labels:
      trainergroup.local/pool: cpu
$(node_mounts worker2)
EOF
}

node_mounts() {  # <node suffix>: a worker's extraMounts: the shared tree, the kept containerd store
  printf '    extraMounts:\n      - hostPath: %s\n        containerPath: %s\n' "$SHARED_DIR" "$SHARED_MOUNT"
  [[ "$KEEP_STORES" == 1 ]] || return 0
  printf '      - hostPath: %s\n        containerPath: /var/lib/containerd\n' "$STORES/$1"
}

# The kept stores start as a copy of the node image's own /var/lib/containerd (its preloaded
# control-plane and CNI images), once per node image; a store made from another node image is
# thrown away and seeded again. Stale pods of an earlier cluster in a store are garbage
# collected by the new kubelet, as after a node reboot.
seed_stores() {  # <node image>
  [[ "$KEEP_STORES" == 1 ]] || return 0
  local id n dir; id="$("$DOCKER" image inspect -f '{{.Id}}' "$1")"
  for n in worker worker2; do
    dir="$STORES/$n"
    [[ -d "$dir" && "$(cat "$dir.seeded" 2>/dev/null)" == "$id" ]] && continue
    log "seeding the kept containerd store of $CLUSTER-$n from $1"
    rm -rf "$dir" "$dir.seeded"; mkdir -p "$dir"
    "$DOCKER" run --rm --entrypoint cp -v "$dir:/out" "$1" -a /var/lib/containerd/. /out/ \
      || { rm -rf "$dir"; die "could not seed $dir from $1 (disk space? df -h $TG_KIND_CACHE)"; }
    echo "$id" > "$dir.seeded"
  done
}
drop_stores() {  # a cluster that failed to come up does not leave its stores for the next one
  [[ "$KEEP_STORES" == 1 && -d "$STORES" ]] || return 0
  log "removing the kept containerd stores $STORES (the cluster did not come up with them)"
  rm -rf "$STORES"
}

# The kubelet refreshes a pod's mounted Secrets and ConfigMaps on its sync period: kubeadm's 1m
# made the e2e's key-added/key-removed checks (tests/e2e/phases/tinker.sh) wait 50-80 s each.
# Set on new and reused nodes alike (a restart only where the value differs); pods keep running.
KUBELET_SYNC="${TG_KIND_KUBELET_SYNC:-10s}"
tune_kubelets() {
  local n cfg=/var/lib/kubelet/config.yaml
  for n in "$CP_NODE" "$GPU_NODE" "$CPU_NODE"; do
    "$DOCKER" exec "$n" grep -qx "syncFrequency: $KUBELET_SYNC" "$cfg" && continue
    "$DOCKER" exec "$n" sh -c "sed -i '/^syncFrequency:/d' $cfg && echo 'syncFrequency: $KUBELET_SYNC' >> $cfg && systemctl restart kubelet" \
      || fail "could not set syncFrequency in $n:$cfg"
    log "kubelet on $n: syncFrequency $KUBELET_SYNC (restarted)"
  done
}

advertise_gpus() {
  log "advertising nvidia.com/gpu: $GPUS on $GPU_NODE (PATCH nodes/$GPU_NODE/status)"
  k patch node "$GPU_NODE" --subresource=status --type=json -p "[
    {\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$GPUS\"},
    {\"op\":\"add\",\"path\":\"/status/allocatable/nvidia.com~1gpu\",\"value\":\"$GPUS\"}]" >/dev/null \
    || fail "patching $GPU_NODE's status failed"
  local deadline=$((SECONDS + 60)) got=""
  while (( SECONDS < deadline )); do
    got="$(k get node "$GPU_NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}' 2>/dev/null || true)"
    [[ "$got" == "$GPUS" ]] && return 0
    sleep 2
  done
  fail "$GPU_NODE allocatable nvidia.com/gpu is '$got', expected $GPUS (after 60s)"
}

wait_ready() {
  local t0=$SECONDS
  log "waiting (<= ${WAIT}s) for 3 nodes Ready"
  local deadline=$((SECONDS + WAIT))
  until [[ "$(k get nodes --no-headers 2>/dev/null | wc -l)" -eq 3 ]]; do
    (( SECONDS < deadline )) || fail "fewer than 3 nodes registered after ${WAIT}s"
    sleep 2
  done
  k wait --for=condition=Ready node --all --timeout="$((deadline - SECONDS > 1 ? deadline - SECONDS : 1))s" >/dev/null \
    || fail "not all nodes Ready after ${WAIT}s (CNI up? see tg-cni pods and kubelet logs below)"
  log "nodes Ready after $((SECONDS - t0))s"
  log "waiting (<= ${WAIT}s) for the tg-cni DaemonSet and CoreDNS"
  k -n kube-system rollout status ds/tg-cni --timeout="${WAIT}s" >/dev/null || fail "tg-cni DaemonSet not ready after ${WAIT}s"
  k -n kube-system rollout status ds/kube-proxy --timeout="${WAIT}s" >/dev/null || fail "kube-proxy DaemonSet not ready after ${WAIT}s"
  k -n kube-system rollout status deploy/coredns --timeout="${WAIT}s" >/dev/null || fail "CoreDNS not ready after ${WAIT}s"
  local bad; bad="$(k get pods -A --no-headers | grep -Ev ' (Running|Completed) ' || true)"
  [[ -z "$bad" ]] || fail "pods not Running in the new cluster: $bad"
  log "kube-system ready after $((SECONDS - t0))s"
}

# kind drives its nodes with `docker exec` into privileged containers. On this VM that needs
# the runc wrapper to drop CAP_SYS_RESOURCE from `runc exec --process` too, not only from
# `runc create` (see docs/kind-cluster.md). Fail early and clearly if it does not.
preflight_exec() {
  local img; img="$(bash "$KIND_DIR/build-node-image.sh" --print-tags | sed -n 's/^NET_IMAGE=//p')"
  image_exists "$img" || return 0
  local c; c="$("$DOCKER" run -d --rm --privileged --entrypoint sleep "$img" 60 2>&1)" \
    || die "docker cannot start a privileged container ($c); is hack/docker/up.sh's runc wrapper registered?"
  local out; out="$("$DOCKER" exec "$c" true 2>&1)" || {
    "$DOCKER" rm -f "$c" >/dev/null 2>&1 || true
    die "docker exec into a privileged container fails here ($out): the runc wrapper must also strip CAP_SYS_RESOURCE from 'runc exec --process FILE'; see docs/kind-cluster.md"; }
  "$DOCKER" rm -f "$c" >/dev/null 2>&1 || true
}

cmd_up() {
  [[ "${TG_KIND_GPU:-0}" == 0 ]] || die "TG_KIND_GPU=1 (real NVIDIA GPUs in kind) is not implemented yet: see docs/kind-cluster.md 'GPU hosts (TODO)'"
  tools
  local image="${TG_KIND_NODE_IMAGE:-}"
  [[ -n "$image" ]] || image="$(bash "$KIND_DIR/build-node-image.sh" | tail -n1)"
  image_exists "$image" || die "node image $image not found (build it: bash hack/kind/build-node-image.sh)"
  if cluster_exists; then
    local have; have="$("$DOCKER" inspect -f '{{.Config.Image}}' "$CP_NODE" 2>/dev/null || true)"
    if [[ "$have" != "$image" && "${TG_KIND_RECREATE:-0}" == 1 ]]; then
      log "cluster $CLUSTER runs $have, not $image: recreating (TG_KIND_RECREATE=1)"
      "$KIND" delete cluster --name "$CLUSTER" >&2
    else
      # A running cluster is never replaced under its users just because the recipe moved on.
      [[ "$have" == "$image" ]] || log "warning: cluster $CLUSTER runs node image $have, not the current $image; reusing it (TG_KIND_RECREATE=1 recreates)"
      "$KIND" get kubeconfig --name "$CLUSTER" >"$KUBECONFIG_OUT" 2>/dev/null || true
      if healthy; then
        log "reusing healthy cluster $CLUSTER ($image)"
        tune_kubelets; advertise_gpus; wait_ready
        echo "$KUBECONFIG_OUT"; return 0
      fi
      log "cluster $CLUSTER exists but is not healthy: recreating"
      "$KIND" delete cluster --name "$CLUSTER" >&2
    fi
  fi
  preflight_exec
  seed_stores "$image"
  # a new cluster starts with an empty shared tree (root's, 0755, like a fresh NFS export)
  rm -rf "$SHARED_DIR" && mkdir -p "$SHARED_DIR" && chmod 0755 "$SHARED_DIR"
  local cfg; cfg="$(mktemp)"; kind_config >"$cfg"
  log "kind create cluster --name $CLUSTER --image $image"
  local t0=$SECONDS
  with_timeout 900 "kind create cluster" "$KIND" create cluster --name "$CLUSTER" --image "$image" \
      --config "$cfg" --kubeconfig "$KUBECONFIG_OUT" --wait 0s --retain >&2 \
    || { rm -f "$cfg"; drop_stores; fail "kind create cluster failed (nodes kept for the diagnostics above; remove them with: bash hack/kind/cluster.sh down)"; }
  rm -f "$cfg"
  log "kind create cluster returned after $((SECONDS - t0))s"
  tune_kubelets
  ( wait_ready ) || { drop_stores; exit 1; }
  advertise_gpus
  echo "$(date -u +%FT%TZ) cluster up (create+ready) $((SECONDS - t0))s" >>"$TG_KIND_CACHE/timings.log"
  log "cluster $CLUSTER ready in $((SECONDS - t0))s; kubeconfig: $KUBECONFIG_OUT"
  echo "$KUBECONFIG_OUT"
}

cmd_status() {
  tools
  cluster_exists || { log "no kind cluster named $CLUSTER"; return 1; }
  [[ -f "$KUBECONFIG_OUT" ]] || "$KIND" get kubeconfig --name "$CLUSTER" >"$KUBECONFIG_OUT"
  echo "kubeconfig: $KUBECONFIG_OUT"
  echo "image: $("$DOCKER" inspect -f '{{.Config.Image}}' "$CP_NODE" 2>/dev/null || echo '?')"
  k get nodes -L nvidia.com/gpu.present,trainergroup.local/pool \
    -o custom-columns='NAME:.metadata.name,READY:.status.conditions[?(@.type=="Ready")].status,GPU:.status.allocatable.nvidia\.com/gpu,TAINTS:.spec.taints[*].key,POOL:.metadata.labels.trainergroup\.local/pool' || true
  k get pods -n kube-system -o wide || true
  "$DOCKER" stats --no-stream --format '{{.Name}} {{.MemUsage}} {{.CPUPerc}}' \
    $("$DOCKER" ps -q --filter "label=io.x-k8s.kind.cluster=$CLUSTER") || true
  healthy && { log "healthy"; return 0; }
  log "NOT healthy"; return 1
}

cmd_down() {
  tools
  if cluster_exists; then
    "$KIND" delete cluster --name "$CLUSTER" >&2
  else
    log "no kind cluster named $CLUSTER"
  fi
  rm -f "$KUBECONFIG_OUT"
}

locked() {  # one up/down at a time per cluster name
  exec 9>"$TG_KIND_CACHE/$CLUSTER.lock"
  flock -w "$((WAIT * 3))" 9 || die "another cluster.sh holds $TG_KIND_CACHE/$CLUSTER.lock for more than $((WAIT * 3))s"
  "$@"
}

case "${1:-}" in
  up) locked cmd_up ;;
  down) locked cmd_down ;;
  status) cmd_status ;;
  check) exec bash "$KIND_DIR/check.sh" ;;
  diag) tools; diag ;;
  *) echo "usage: $0 up|down|status|check|diag   (env: TG_KIND_CLUSTER=$CLUSTER)" >&2; exit 2 ;;
esac
