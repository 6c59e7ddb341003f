#!/usr/bin/env bash
# A Redis for KubeRay's GCS fault tolerance in the kind cluster, from Debian's packages.
#
#   bash hack/kind/redis.sh up NAMESPACE   # build (cached) + load + Deployment/Service "redis"
#   bash hack/kind/redis.sh image          # only build the image; prints its tag
#
# The address for spec.rayCluster.gcsFaultTolerance.redisAddress is redis.NAMESPACE.svc:6379.
# Env: TG_KIND_CLUSTER (default tg-kind).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CLUSTER="${TG_KIND_CLUSTER:-tg-kind}"
MODE="${1:-up}"

image() {
  local net h tag df="$REPO_ROOT/hack/images/redis/Dockerfile" ctx
  net="$(bash "$KIND_DIR/build-node-image.sh" --print-tags | sed -n 's/^NET_IMAGE=//p')"
  image_exists "$net" || die "no $net: build the kind node image first (hack/kind/build-node-image.sh)"
  h="$(hash_of "$net" "$df")"
  tag="trainergroup.local/tg-redis:$h"
  if ! image_exists "$tag"; then
    ctx="$(mktemp -d)"
    log "docker build $tag (Debian's redis-server)"
    "$DOCKER" build -q -t "$tag" -f "$df" --build-arg "NET_IMAGE=$net" "$ctx" >/dev/null \
      || { rm -rf "$ctx"; die "docker build of $tag failed"; }
    rm -rf "$ctx"
  fi
  echo "$tag"
}

case "$MODE" in
  image) image ;;
  up)
    NS="${2:?usage: $0 up NAMESPACE}"
    BIN="$(tools_bin)"
    tag="$(image)"
    TG_KIND_CLUSTER="$CLUSTER" bash "$KIND_DIR/load-image.sh" "$tag"
    cat <<YAML | "$BIN/kubectl" --context "kind-$CLUSTER" apply -f - >/dev/null
apiVersion: apps/v1
kind: Deployment
metadata: {name: redis, namespace: $NS, labels: {app: redis}}
spec:
  selector: {matchLabels: {app: redis}}
  template:
    metadata: {labels: {app: redis}}
    spec:
      securityContext:  # the "restricted" Pod Security Standard (tests/e2e/run.sh enforces it)
        runAsNonRoot: true
        runAsUser: 999
        runAsGroup: 999
        seccompProfile: {type: RuntimeDefault}
      containers:
        - name: redis
          image: $tag
          securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
          imagePullPolicy: Never
          ports: [{containerPort: 6379}]
          readinessProbe: {tcpSocket: {port: 6379}, periodSeconds: 2}
          resources: {requests: {cpu: 20m, memory: 64Mi}, limits: {memory: 512Mi}}
---
apiVersion: v1
kind: Service
metadata: {name: redis, namespace: $NS}
spec:
  selector: {app: redis}
  ports: [{port: 6379, targetPort: 6379}]
YAML
    "$BIN/kubectl" --context "kind-$CLUSTER" -n "$NS" rollout status deploy/redis --timeout=180s >&2 \
      || die "redis not ready in $NS"
    log "redis up: redis.$NS.svc:6379 ($tag)" ;;
  *) die "usage: $0 up NAMESPACE | image" ;;
esac
