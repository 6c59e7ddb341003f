#!/usr/bin/env bash
# End to end on kind with NVIDIA GPUs: build the images, create a kind cluster whose node has
# the host's GPUs, install NVIDIA's device plugin, KubeRay and the TrainerGroup chart, apply
# the example TrainerGroup (2 workers, tensor parallel 2, 2 GPUs), wait for Ready, run the
# example client Job (10 training steps), check the status and the client's log, delete the
# TrainerGroup and check that nothing is left. Prints "E2E PASSED" last when all is well.
#
#   tests/e2e/run.sh              (or `make e2e`; tests/e2e/test_e2e_kind.py runs it too)
#
# Needs: Docker (engine reachable) with the NVIDIA runtime as its default and
# accept-nvidia-visible-devices-as-volume-mounts=true (see kind-config.yaml), kind, kubectl,
# helm, python3, and >= 2 NVIDIA GPUs with a driver for CUDA 13 (>= 580).
#
# Settings (environment):
#   E2E_CLUSTER=tg-e2e              kind cluster name
#   E2E_KEEP_CLUSTER=0              1: leave the cluster up afterwards (also on failure)
#   E2E_SKIP_BUILD=0                1: use already-built images ($OPERATOR_IMAGE, $RUNTIME_IMAGE)
#   E2E_ARTIFACTS=tests/e2e/.artifacts   diagnostics written here on failure
#   E2E_STEPS=10                    client training steps
#   E2E_READY_TIMEOUT=1800          seconds for the TrainerGroup to become Ready
#   E2E_WORKER_CPU=4 E2E_WORKER_MEMORY=24Gi E2E_HEAD_CPU=1 E2E_HEAD_MEMORY=4Gi
#                                   Ray pod sizes (the example asks for more than a laptop has)
#   KIND_NODE_IMAGE=kindest/node:v1.34.0
#   KUBERAY_VERSION=<hack/versions.env>   kuberay-operator Helm chart version
#   NVDP_VERSION=0.17.1             NVIDIA device plugin Helm chart version
#   NVIDIA_CTK_VERSION=             nvidia-container-toolkit apt version in the node (empty: latest)
#   OPERATOR_IMAGE, RUNTIME_IMAGE   default ghcr.io/trainergroup/{operator,runtime}:<appVersion>
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"

APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/trainergroup/Chart.yaml)"
CLUSTER="${E2E_CLUSTER:-tg-e2e}"
NODE="${CLUSTER}-control-plane"
KIND_NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.34.0}"
# The KubeRay version the local control plane tests against (hack/versions.env), chart form.
PINNED_KUBERAY="$(sed -n 's/^KUBERAY_VERSION=v\{0,1\}//p' hack/versions.env)"
KUBERAY_VERSION="${KUBERAY_VERSION:-$PINNED_KUBERAY}"
NVDP_VERSION="${NVDP_VERSION:-0.17.1}"
NVIDIA_CTK_VERSION="${NVIDIA_CTK_VERSION:-}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-ghcr.io/trainergroup/operator:$APP_VERSION}"
RUNTIME_IMAGE="${RUNTIME_IMAGE:-ghcr.io/trainergroup/runtime:$APP_VERSION}"
STEPS="${E2E_STEPS:-10}"
READY_TIMEOUT="${E2E_READY_TIMEOUT:-1800}"
ARTIFACTS="${E2E_ARTIFACTS:-$REPO/tests/e2e/.artifacts}"
HELM="${HELM:-helm}"
OP_NS=trainergroup-system
TG=llama-tp2
TG_NS=default

log() { printf '%s e2e: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found on PATH ($2)"; }
k() { kubectl --context "kind-$CLUSTER" "$@"; }
h() { "$HELM" --kube-context "kind-$CLUSTER" "$@"; }

# ---- preflight --------------------------------------------------------------------------------
need docker "Docker engine with the NVIDIA runtime"
need kind "https://kind.sigs.k8s.io"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
command -v "$HELM" >/dev/null 2>&1 || die "helm not found (set HELM=/path/to/helm)"
need python3 "for JSON checks"
need nvidia-smi "NVIDIA driver"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info)"
GPUS="$(nvidia-smi -L | grep -c '^GPU ' || true)"
(( GPUS >= 2 )) || die "the example needs 2 GPUs on one node; nvidia-smi lists $GPUS"
RUNTIME="$(docker info --format '{{.DefaultRuntime}}')"
[[ "$RUNTIME" == nvidia ]] || die "Docker's default runtime is '$RUNTIME', not nvidia: sudo nvidia-ctk runtime configure --runtime=docker --set-as-default && sudo systemctl restart docker"
if ! grep -Eq '^\s*accept-nvidia-visible-devices-as-volume-mounts\s*=\s*true' /etc/nvidia-container-runtime/config.toml 2>/dev/null; then
  die "set accept-nvidia-visible-devices-as-volume-mounts=true: sudo nvidia-ctk config --set accept-nvidia-visible-devices-as-volume-mounts=true --in-place"
fi
log "$GPUS GPUs; cluster $CLUSTER; images $OPERATOR_IMAGE, $RUNTIME_IMAGE; KubeRay $KUBERAY_VERSION"

diagnose() {
  mkdir -p "$ARTIFACTS"
  log "collecting diagnostics in $ARTIFACTS"
  {
    k get nodes -o wide; k get all -A -o wide; k get tg -A -o yaml; k get raycluster -A -o yaml
    k get events -A --sort-by=.lastTimestamp
  } > "$ARTIFACTS/cluster.txt" 2>&1 || true
  k -n "$OP_NS" logs deploy/trainergroup-operator --tail=-1 > "$ARTIFACTS/operator.log" 2>&1 || true
  k -n "$TG_NS" logs job/$TG-client --tail=-1 > "$ARTIFACTS/client.log" 2>&1 || true
  k -n "$TG_NS" logs -l ray.io/cluster=$TG,ray.io/node-type=head --tail=-1 > "$ARTIFACTS/ray-head.log" 2>&1 || true
  k -n "$TG_NS" logs -l ray.io/cluster=$TG,ray.io/node-type=worker --tail=-1 > "$ARTIFACTS/ray-workers.log" 2>&1 || true
  k -n "$TG_NS" exec "$(k -n "$TG_NS" get pod -l ray.io/cluster=$TG,ray.io/node-type=head -o name | head -n1)" -- \
    bash -c 'tail -n 200 /tmp/ray/session_latest/logs/job-driver-*.log' > "$ARTIFACTS/ray-jobs.log" 2>&1 || true
}
finish() {
  local rc=$?
  if (( rc != 0 )); then diagnose; fi
  if [[ "${E2E_KEEP_CLUSTER:-0}" != 1 ]]; then
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  else
    log "cluster kept: kubectl --context kind-$CLUSTER ..."
  fi
  exit "$rc"
}

# ---- 1. images ----------------------------------------------------------------------------------
if [[ "${E2E_SKIP_BUILD:-0}" != 1 ]]; then
  log "building images (make images)"
  make images OPERATOR_IMAGE="$OPERATOR_IMAGE" RUNTIME_IMAGE="$RUNTIME_IMAGE"
fi
docker image inspect "$OPERATOR_IMAGE" "$RUNTIME_IMAGE" >/dev/null \
  || die "images missing: $OPERATOR_IMAGE $RUNTIME_IMAGE (build them, or unset E2E_SKIP_BUILD)"

# ---- 2. kind with GPUs ------------------------------------------------------------------------------
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
trap finish EXIT
log "creating kind cluster $CLUSTER ($KIND_NODE_IMAGE)"
kind create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" \
  --config tests/e2e/kind-config.yaml --wait 180s

log "NVIDIA container toolkit inside the node, as containerd's default runtime"
# The host's read-only /proc/driver/nvidia mount hides the driver's state from the toolkit.
docker exec "$NODE" umount -R /proc/driver/nvidia 2>/dev/null || true
docker exec "$NODE" bash -euc '
  apt-get update -qq && apt-get install -y -qq --no-install-recommends gnupg curl ca-certificates >/dev/null
  curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
    | gpg --dearmor -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
  curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
    | sed "s#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#g" \
    > /etc/apt/sources.list.d/nvidia-container-toolkit.list
  apt-get update -qq
  pkg=nvidia-container-toolkit; [ -n "$1" ] && pkg="nvidia-container-toolkit=$1"
  apt-get install -y -qq "$pkg" >/dev/null
  nvidia-ctk runtime configure --runtime=containerd --set-as-default
  systemctl restart containerd
' _ "$NVIDIA_CTK_VERSION"
k label node "$NODE" nvidia.com/gpu.present=true --overwrite
k wait --for=condition=Ready "node/$NODE" --timeout=180s

log "NVIDIA device plugin $NVDP_VERSION"
h repo add nvdp https://nvidia.github.io/k8s-device-plugin --force-update >/dev/null
h repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update >/dev/null
h repo update >/dev/null
h install nvidia-device-plugin nvdp/nvidia-device-plugin --version "$NVDP_VERSION" \
  --namespace nvidia-device-plugin --create-namespace --wait --timeout 5m
for _ in $(seq 60); do
  ALLOC="$(k get node "$NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')"
  [[ -n "$ALLOC" && "$ALLOC" -ge 2 ]] && break
  sleep 5
done
[[ -n "${ALLOC:-}" && "$ALLOC" -ge 2 ]] || die "node $NODE advertises '${ALLOC:-0}' nvidia.com/gpu (want >= 2)"
log "node advertises $ALLOC GPUs"

log "loading images into the node"
kind load docker-image "$OPERATOR_IMAGE" "$RUNTIME_IMAGE" --name "$CLUSTER"

log "GPU smoke test: torch sees 2 GPUs in the runtime image"
k run gpu-smoke --restart=Never --image "$RUNTIME_IMAGE" --image-pull-policy=Never \
  --overrides='{"spec":{"containers":[{"name":"gpu-smoke","image":"'"$RUNTIME_IMAGE"'","imagePullPolicy":"Never","command":["python","-c","import torch; n = torch.cuda.device_count(); print(\"GPUS\", n, torch.cuda.get_device_name(0)); assert n == 2"],"resources":{"limits":{"nvidia.com/gpu":2}}}]}}'
k wait --for=jsonpath='{.status.phase}'=Succeeded pod/gpu-smoke --timeout=600s \
  || { k logs gpu-smoke || true; die "the GPU smoke pod did not succeed"; }
k logs gpu-smoke
k delete pod gpu-smoke --wait=false

# ---- 3. KubeRay and the chart -------------------------------------------------------------------------
log "KubeRay operator $KUBERAY_VERSION"
h install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" \
  --namespace kuberay-system --create-namespace --wait --timeout 5m

log "TrainerGroup chart"
k apply -f manifests/namespace.yaml   # Pod Security "restricted" for the operator
h install trainergroup charts/trainergroup --namespace "$OP_NS" --wait --timeout 5m \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never \
  --set "clients[0].name=trainergroup-client" --set "clients[0].namespace=$TG_NS" \
  --set "clients[0].trainerGroups[0]=$TG"
k -n "$OP_NS" rollout status deploy/trainergroup-operator --timeout=180s

# ---- 4. the example TrainerGroup --------------------------------------------------------------------------
log "applying the example TrainerGroup (Ray pods resized for this machine)"
PATCH="$(python3 -c 'import json, os; e = os.environ.get
print(json.dumps({"spec": {"image": os.environ["RUNTIME_IMAGE"], "rayCluster": {
  "head": {"cpu": e("E2E_HEAD_CPU", "1"), "memory": e("E2E_HEAD_MEMORY", "4Gi")},
  "workers": {"cpu": e("E2E_WORKER_CPU", "4"), "memory": e("E2E_WORKER_MEMORY", "24Gi")}}}}))')"
export RUNTIME_IMAGE
k patch --local -f manifests/examples/trainergroup.yaml --type merge -p "$PATCH" -o yaml \
  | k apply -f -
T0=$(date +%s)
while :; do
  PHASE="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.phase}')"
  [[ "$PHASE" == Ready ]] && break
  [[ "$PHASE" == Failed ]] && die "TrainerGroup $TG is Failed: $(k -n "$TG_NS" get tg "$TG" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}; {end}')"
  (( $(date +%s) - T0 < READY_TIMEOUT )) || die "TrainerGroup $TG not Ready after ${READY_TIMEOUT}s (phase '$PHASE')"
  sleep 10
done
log "TrainerGroup Ready after $(( $(date +%s) - T0 ))s"
k -n "$TG_NS" get tg "$TG" -o wide

k -n "$TG_NS" get tg "$TG" -o json | python3 -c '
import json, sys
tg = json.load(sys.stdin); st = tg["status"]; name = tg["metadata"]["name"]; ns = tg["metadata"]["namespace"]
def check(ok, what):
    if not ok: sys.exit(f"status check failed: {what}: {json.dumps(st, indent=1)}")
check(st["phase"] == "Ready", "phase Ready")
check(st["worldSize"] == 2 and st.get("readyWorkers") == 2, "worldSize 2, readyWorkers 2")
check(len(st["workerNames"]) == 2 and len(set(st["workerNames"])) == 2, "2 distinct workerNames")
check(st["mesh"]["tp"] == 2 and st["mesh"]["dp"] == 1, "mesh tp=2 dp=1")
check(st["rayClusterName"] == name, "rayClusterName")
check(st["rayAddress"] == f"{name}-head-svc.{ns}.svc:6379", "rayAddress")
check(st["rayNamespace"] == f"tg-{ns}-{name}", "rayNamespace")
check(st.get("observedGeneration") == tg["metadata"]["generation"], "observedGeneration")
conds = {c["type"]: c["status"] for c in st["conditions"]}
check(conds.get("RayClusterReady") == "True" and conds.get("WorkersReady") == "True", "conditions")
check(all(w.get("state") == "ALIVE" for w in st.get("workers", [])), "every worker ALIVE")
print("status OK:", st["workerNames"])
'
k -n "$TG_NS" get raycluster "$TG" >/dev/null || die "RayCluster $TG missing"

# ---- 5. the client Job --------------------------------------------------------------------------------
log "client Job: $STEPS steps"
sed -e "s#image: ghcr.io/trainergroup/runtime:[^ ]*#image: $RUNTIME_IMAGE#" \
    -e "s#imagePullPolicy: IfNotPresent#imagePullPolicy: Never#" manifests/examples/client-job.yaml \
  | k set env --local -f - "TG_STEPS=$STEPS" -o yaml | k apply -f -
T0=$(date +%s)
while :; do
  DONE="$(k -n "$TG_NS" get job "$TG-client" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {end}')"
  [[ "$DONE" == *"Complete=True"* ]] && break
  [[ "$DONE" == *"Failed=True"* ]] && { k -n "$TG_NS" logs "job/$TG-client" --tail=50 || true; die "client Job failed"; }
  (( $(date +%s) - T0 < 1800 )) || die "client Job not done after 1800s"
  sleep 5
done
k -n "$TG_NS" logs "job/$TG-client" --tail=-1 > "${TMPDIR:-/tmp}/tg-e2e-client.log"
STEPS="$STEPS" python3 - "${TMPDIR:-/tmp}/tg-e2e-client.log" <<'EOF'
import json, math, os, sys
# stdout and stderr (progress bar) share the log: TG_STEP may follow a \r-drawn bar
steps = [json.loads(line.split("TG_STEP ", 1)[1]) for line in open(sys.argv[1])
         if "TG_STEP " in line]
want = int(os.environ["STEPS"])
if len(steps) != want:
    sys.exit(f"client log has {len(steps)} TG_STEP lines, want {want}")
numbers = [s["step"] for s in steps]
if numbers != sorted(set(numbers)):
    sys.exit(f"steps not increasing: {numbers}")
losses = [s["loss"] for s in steps]
if not all(math.isfinite(x) and x > 0 for x in losses):
    sys.exit(f"non-finite or non-positive loss: {losses}")
# vocab 256: a fresh model starts near ln(256) = 5.55
if not 3.0 < losses[0] < 8.0:
    sys.exit(f"first loss {losses[0]} is not near ln(256)")
print(f"client OK: {want} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
EOF

# ---- 6. deletion leaves nothing behind ------------------------------------------------------------------
log "deleting the TrainerGroup"
k -n "$TG_NS" delete job "$TG-client" --wait=false
k -n "$TG_NS" delete tg "$TG" --timeout=600s
for _ in $(seq 60); do
  LEFT="$(k -n "$TG_NS" get raycluster,pods -l "ray.io/cluster=$TG" -o name 2>/dev/null; k -n "$TG_NS" get raycluster "$TG" -o name 2>/dev/null || true)"
  [[ -z "$LEFT" ]] && break
  sleep 5
done
[[ -z "$LEFT" ]] || die "left behind after deletion: $LEFT"

log "all checks passed"
echo "E2E PASSED"
