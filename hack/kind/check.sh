#!/usr/bin/env bash
# Prove the kind cluster from hack/kind/cluster.sh works as a network:
#   - a pod on the GPU worker (tolerating its taint, requesting nvidia.com/gpu: 1) and a pod
#     on the CPU worker reach each other by pod IP (HTTP both ways);
#   - a Service name resolves through CoreDNS and answers from the other node.
# Images: the Debian utility image built by build-node-image.sh (busybox httpd/wget/nslookup),
# preloaded in the node image; imagePullPolicy: Never (nothing can be pulled here).
# Env: TG_KIND_CLUSTER, TG_KIND_KUBECONFIG (as cluster.sh), TG_KIND_KEEP=1 keeps the namespace.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

CLUSTER="${TG_KIND_CLUSTER:-tg-kind}"
KUBECONFIG_OUT="${TG_KIND_KUBECONFIG:-$TG_KIND_CACHE/$CLUSTER.kubeconfig}"
NS="${TG_KIND_CHECK_NS:-tg-kind-check}"
WAIT="${TG_KIND_TIMEOUT:-180}"
[[ -f "$KUBECONFIG_OUT" ]] || die "no kubeconfig at $KUBECONFIG_OUT: run 'bash hack/kind/cluster.sh up' first"
BIN="$(tools_bin)"
k() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" --request-timeout=30s "$@"; }
eval "$(bash "$KIND_DIR/build-node-image.sh" --print-tags)"   # NET_IMAGE
T0=$SECONDS

fail() {
  echo "------ diagnostics ------" >&2
  k -n "$NS" get pods,svc,endpoints -o wide >&2 || true
  k -n "$NS" get events --sort-by=.lastTimestamp >&2 2>/dev/null | tail -15 || true
  k -n kube-system get pods -o wide >&2 || true
  k -n kube-system logs ds/tg-cni --tail=10 >&2 2>/dev/null || true
  die "$*"
}

k delete namespace "$NS" --ignore-not-found --wait=true --timeout=60s >/dev/null || true
k create namespace "$NS" >/dev/null
pod() {  # <name> <pool> <extra spec yaml (indented 2)>
  cat <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: $1
  namespace: $NS
  labels: {app: $1}
spec:
  nodeSelector: {trainergroup.local/pool: $2}
  terminationGracePeriodSeconds: 1
$3
  containers:
    - name: web
      image: $NET_IMAGE
      imagePullPolicy: Never
      command: ["sh", "-c", "mkdir -p /www && echo \"hello from \$(hostname) on \$NODE\" > /www/index.html && exec httpd -f -p 8080 -h /www"]
      env:
        - name: NODE
          valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
      ports: [{containerPort: 8080}]
      readinessProbe:
        httpGet: {path: /, port: 8080}
        periodSeconds: 2
      resources:
        requests: {cpu: 10m, memory: 16Mi}
        limits: {memory: 64Mi$4}
---
EOF
}
{
  pod gpu-web gpu '  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}' ', nvidia.com/gpu: 1'
  pod cpu-web cpu '' ''
  cat <<EOF
apiVersion: v1
kind: Service
metadata: {name: gpu-web, namespace: $NS}
spec:
  selector: {app: gpu-web}
  ports: [{port: 80, targetPort: 8080}]
EOF
} | k apply -f - >/dev/null || fail "creating the check pods failed"

log "waiting (<= ${WAIT}s) for gpu-web and cpu-web Ready"
k -n "$NS" wait --for=condition=Ready pod/gpu-web pod/cpu-web --timeout="${WAIT}s" >/dev/null \
  || fail "check pods not Ready after ${WAIT}s"
GPU_NODE="$(k -n "$NS" get pod gpu-web -o jsonpath='{.spec.nodeName}')"
CPU_NODE="$(k -n "$NS" get pod cpu-web -o jsonpath='{.spec.nodeName}')"
GPU_IP="$(k -n "$NS" get pod gpu-web -o jsonpath='{.status.podIP}')"
CPU_IP="$(k -n "$NS" get pod cpu-web -o jsonpath='{.status.podIP}')"
log "gpu-web $GPU_IP on $GPU_NODE; cpu-web $CPU_IP on $CPU_NODE"
[[ "$GPU_NODE" != "$CPU_NODE" ]] || fail "both pods landed on $GPU_NODE"
[[ "$(k get node "$GPU_NODE" -o jsonpath='{.metadata.labels.nvidia\.com/gpu\.present}')" == true ]] \
  || fail "gpu-web's node $GPU_NODE lacks nvidia.com/gpu.present=true"

# (busybox 1.35 wget segfaults with -T here; the whole exec is bounded instead)
ex() {  # <pod> <cmd...>, bounded
  timeout 60 "$BIN/kubectl" --kubeconfig "$KUBECONFIG_OUT" -n "$NS" exec "$1" -- "${@:2}"
}
expect() {  # <what> <needle> <pod> <cmd...>
  local what="$1" needle="$2" out; shift 2
  out="$(ex "$@" 2>&1)" || fail "$what: command failed: $out"
  grep -q "$needle" <<<"$out" || fail "$what: expected '$needle' in: $out"
  log "ok: $what -> $(head -n1 <<<"$out")"
}
expect "cpu pod -> gpu pod by pod IP" "on $GPU_NODE" cpu-web wget -qO- "http://$GPU_IP:8080/"
expect "gpu pod -> cpu pod by pod IP" "on $CPU_NODE" gpu-web wget -qO- "http://$CPU_IP:8080/"
SVC_IP="$(k -n "$NS" get svc gpu-web -o jsonpath='{.spec.clusterIP}')"
expect "DNS: gpu-web.$NS.svc.cluster.local" "$SVC_IP" cpu-web nslookup "gpu-web.$NS.svc.cluster.local"
expect "Service by DNS name, from the CPU node" "on $GPU_NODE" cpu-web wget -qO- "http://gpu-web.$NS.svc.cluster.local/"
expect "Service by short name (search path)" "on $GPU_NODE" cpu-web wget -qO- "http://gpu-web/"
expect "DNS: kubernetes.default" "Address" gpu-web nslookup kubernetes.default.svc.cluster.local

if [[ "${TG_KIND_KEEP:-0}" != 1 ]]; then
  k delete namespace "$NS" --wait=false >/dev/null || true
fi
log "check passed in $((SECONDS - T0))s"
