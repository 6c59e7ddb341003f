#!/usr/bin/env bash
# NetworkPolicy enforcement for the kind cluster: tg-cni routes pods but enforces no policy.
#
#   bash hack/kind/netpol.sh up      # build (cached) + load + deploy; waits for the DaemonSet
#   bash hack/kind/netpol.sh image   # only build the image; prints its tag
#   bash hack/kind/netpol.sh binary  # only the kube-router binary (no node image needed); its path
#
# The enforcer is kube-router's network-policy controller alone (iptables + ipset, the
# NFQUEUE-free path): kubernetes-sigs/kube-network-policies (v0.8.0) needs nftables' `queue`
# statement, which this VM's kernel lacks (CONFIG_NFT_QUEUE is not set: `nft add rule ...
# queue num 100` fails), so it cannot run here. kube-router
# (github.com/cloudnativelabs/kube-router/v2@KUBE_ROUTER_VERSION, hack/versions.env) is built
# by hack/build-tools.sh in the one `go build` of the Kubernetes tools, and packaged on the kind
# utility image (hack/kind/build-node-image.sh --print-tags: NET_IMAGE).
# Env: TG_KIND_CLUSTER (default tg-kind); TG_K8S_TOOLS_BIN (a built tool set, else build-tools.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CLUSTER="${TG_KIND_CLUSTER:-tg-kind}"
MODE="${1:-up}"

binary() {  # the kube-router binary of the tool set (built or reused by hack/build-tools.sh)
  local bin; bin="$(tools_bin)"
  [[ -x "$bin/kube-router" ]] || die "$bin has no kube-router: run 'bash hack/build-tools.sh' (BUILD_RECIPE >= 3 builds it)"
  echo "$bin/kube-router"
}

image() {  # build (or reuse) the image; prints its tag
  local bin net h tag ctx df="$REPO_ROOT/hack/images/netpol/Dockerfile"
  bin="$(binary)"
  net="$(bash "$KIND_DIR/build-node-image.sh" --print-tags | sed -n 's/^NET_IMAGE=//p')"
  image_exists "$net" || die "no $net: build the kind node image first (hack/kind/build-node-image.sh)"
  h="$(hash_of "$net $KUBE_ROUTER_VERSION" "$df" "$bin")"
  tag="trainergroup.local/tg-netpol:$h"
  if ! image_exists "$tag"; then
    ctx="$(mktemp -d)"; mkdir -p "$ctx/bin"; cp "$bin" "$ctx/bin/kube-router"
    log "docker build $tag"
    "$DOCKER" build -q -t "$tag" -f "$df" --build-arg "NET_IMAGE=$net" "$ctx" >/dev/null \
      || { rm -rf "$ctx"; die "docker build of $tag failed"; }
    rm -rf "$ctx"
  fi
  echo "$tag"
}

manifest() {  # <image>
  cat <<YAML
apiVersion: v1
kind: ServiceAccount
metadata: {name: tg-netpol, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: tg-netpol}
rules:
  - apiGroups: [""]
    resources: [namespaces, pods, services, nodes, endpoints]
    verbs: [get, list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: tg-netpol}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: tg-netpol}
subjects: [{kind: ServiceAccount, name: tg-netpol, namespace: kube-system}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: tg-netpol, namespace: kube-system, labels: {k8s-app: tg-netpol}}
spec:
  selector: {matchLabels: {k8s-app: tg-netpol}}
  template:
    metadata: {labels: {k8s-app: tg-netpol}}
    spec:
      serviceAccountName: tg-netpol
      hostNetwork: true
      priorityClassName: system-node-critical
      tolerations: [{operator: Exists}]
      containers:
        - name: kube-router
          image: $1
          imagePullPolicy: Never
          args: [--run-router=false, --run-firewall=true, --run-service-proxy=false,
                 --enable-cni=false, --health-port=20244]
          env:
            - name: NODE_NAME
              valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
          securityContext: {privileged: true}
          readinessProbe:
            httpGet: {path: /healthz, port: 20244}
            periodSeconds: 3
          resources: {requests: {cpu: 20m, memory: 64Mi}}
          volumeMounts:
            - {name: lib-modules, mountPath: /lib/modules, readOnly: true}
            - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
        - {name: lib-modules, hostPath: {path: /lib/modules}}
        - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
YAML
}

case "$MODE" in
  image) image ;;
  binary) binary ;;
  up)
    BIN="$(tools_bin)"
    tag="$(image)"
    TG_KIND_CLUSTER="$CLUSTER" bash "$KIND_DIR/load-image.sh" "$tag"
    manifest "$tag" | "$BIN/kubectl" --context "kind-$CLUSTER" apply -f - >/dev/null
    "$BIN/kubectl" --context "kind-$CLUSTER" -n kube-system rollout status ds/tg-netpol --timeout=180s >&2 \
      || die "tg-netpol DaemonSet not ready (kubectl -n kube-system logs ds/tg-netpol)"
    log "NetworkPolicy enforcer up: kube-router $KUBE_ROUTER_VERSION ($tag)" ;;
  *) die "usage: $0 up|image|binary" ;;
esac
