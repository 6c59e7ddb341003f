#!/usr/bin/env bash
# End to end in real pods on kind: build the images, create a kind cluster, install KubeRay and
# the TrainerGroup chart with Helm, apply the example TrainerGroup (2 workers, tensor parallel
# 2, on the GPU node), wait for Ready, run the example client Job (the loss falls in its log),
# kill the worker pod (Degraded -> Ready under new names), delete the TrainerGroup and check
# that nothing is left. Prints "E2E PASSED" last when all is well.
#
#   tests/e2e/run.sh              (or `make e2e`; tests/e2e/test_e2e_kind.py runs it too)
#
# One script, two GPU modes (E2E_GPU):
#   fake    (default without NVIDIA GPUs) everything is built on this machine, nothing pulled:
#           stand-in base images (hack/images/), the kind node image and a 3-node cluster
#           (hack/kind/: control plane, a "GPU" node advertising nvidia.com/gpu: 8, a CPU
#           node), KubeRay from the go-built binary (hack/kuberay-chart/). The pods have no
#           CUDA: the workers are scheduled as GPU pods and train on CPU with gloo (the
#           trainer picks CPU when torch sees no CUDA; status.device says so).
#   nvidia  (default when nvidia-smi lists >= 2 GPUs) a kind node with the host's GPUs, the
#           NVIDIA container toolkit and device plugin, KubeRay's upstream Helm chart.
#
# Settings (environment):
#   E2E_GPU=auto|fake|nvidia        see above
#   E2E_CLUSTER=tg-e2e              kind cluster name
#   E2E_KEEP_CLUSTER=0              1: leave the cluster up afterwards (also on failure)
#   E2E_REUSE_CLUSTER=0             1 (fake mode): reuse a healthy cluster of that name
#   E2E_STOP_AFTER=                 loaded: stop once the cluster is up with the images in its
#                                   nodes, and keep it (tools/test.sh prepares it this way while
#                                   other tests run, then runs the rest with E2E_REUSE_CLUSTER=1)
#   E2E_SKIP_BUILD=0                1: use already-built images ($OPERATOR_IMAGE, $RUNTIME_IMAGE)
#   E2E_ARTIFACTS=tests/e2e/.artifacts   diagnostics, timings (timeline.json) written here
#   E2E_STEPS=10 (nvidia) / 5 (fake)     client training steps
#   E2E_READY_TIMEOUT=1800          seconds for the TrainerGroup to become Ready
#   E2E_PHASES="resume tinker gateway tls"  phases run after the recovery step (tests/e2e/phases/);
#                                   "" none.
#                                   With the chaos fault worker-killed-mid-step (or
#                                   worker-and-operator-killed) among those
#                                   run, the default is "tinker gateway tls" and step 7 is left out: the
#                                   fault covers both (docs/testing.md, "Merged"). resume: a
#                                   ReadWriteMany claim on two nodes; tls: HTTPS (after tinker);
#                                   gateway: a second group behind the namespace's Tinker gateway
#                                   (before tls, which then trains through it too, the
#                                   gateway verifying spec.api.tls.caBundle; E2E_TLS_GATEWAY=0
#                                   leaves that step out)
#   E2E_TLS_STEPS=2                 steps of phase tls's HTTPS client Job
#   E2E_KUEUE=1 (fake) / 0 (nvidia)   Kueue, built here, admits, queues and preempts groups,
#                                   with the GCS fault-tolerance group as the one holding the
#                                   quota (tests/e2e/phases/kueue.sh, docs/kueue.md); 0: left out
#   E2E_CHAOS=0                     1: then the chaos suite (tests/e2e/chaos.py, ~25 min, docs/chaos.md)
#   E2E_CHAOS_SEED=1 E2E_CHAOS_FAULTS=   its seed; a comma-separated subset of its faults
#   E2E_WORKER_CPU, E2E_WORKER_MEMORY, E2E_HEAD_CPU, E2E_HEAD_MEMORY   Ray pod sizes
#   KIND_NODE_IMAGE=kindest/node:v1.34.0 (nvidia mode only; fake mode builds its own)
#   KUBERAY_VERSION=<hack/versions.env>  NVDP_VERSION=0.17.1  NVIDIA_CTK_VERSION=
#   OPERATOR_IMAGE, RUNTIME_IMAGE   default ghcr.io/trainergroup/{operator,runtime}:<appVersion>
#                                   (fake mode: the runtime's CPU variant, <appVersion>-cpu)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
T_START=$(date +%s)

log() { printf '%s e2e: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
# fd 3: the script's own stderr, so a die inside a condition that wait_for silences (its
# command's output goes to /dev/null) still says why the run stopped
exec 3>&2
die() { log "FAILED: $*" 2>&3; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found on PATH ($2)"; }

# ---- mode ---------------------------------------------------------------------------------------
MODE="${E2E_GPU:-auto}"
if [[ "$MODE" == auto ]]; then
  MODE=fake
  if command -v nvidia-smi >/dev/null 2>&1 && (( $(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true) >= 2 )); then
    MODE=nvidia
  fi
fi
[[ "$MODE" == fake || "$MODE" == nvidia ]] || die "E2E_GPU must be auto, fake or nvidia (got '$MODE')"

APP_VERSION="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/trainergroup/Chart.yaml)"
CLUSTER="${E2E_CLUSTER:-tg-e2e}"
CTX="kind-$CLUSTER"
PINNED_KUBERAY="$(sed -n 's/^KUBERAY_VERSION=//p' hack/versions.env)"
KUBERAY_VERSION="${KUBERAY_VERSION:-$PINNED_KUBERAY}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-ghcr.io/trainergroup/operator:$APP_VERSION}"
# Fake mode's pods have no GPU: they run the CPU variant of the runtime image (no CUDA
# libraries: 3.6 GB instead of 6.55 GB into each node; images/runtime.Dockerfile, VARIANT=cpu).
RUNTIME_VARIANT_SUFFIX=""; [[ "$MODE" == fake ]] && RUNTIME_VARIANT_SUFFIX=-cpu
RUNTIME_IMAGE="${RUNTIME_IMAGE:-ghcr.io/trainergroup/runtime:$APP_VERSION$RUNTIME_VARIANT_SUFFIX}"
KUBERAY_IMAGE="${KUBERAY_IMAGE:-trainergroup.local/kuberay-operator:$KUBERAY_VERSION}"
READY_TIMEOUT="${E2E_READY_TIMEOUT:-1800}"
ARTIFACTS="${E2E_ARTIFACTS:-$REPO/tests/e2e/.artifacts}"
OP_NS=trainergroup-system
KR_NS=kuberay-system
TG=llama-tp2
TG_NS=default
mkdir -p "$ARTIFACTS"
if [[ "$MODE" == fake ]]; then
  STEPS="${E2E_STEPS:-5}"
  E2E_HEAD_CPU="${E2E_HEAD_CPU:-1}" E2E_HEAD_MEMORY="${E2E_HEAD_MEMORY:-3Gi}"
  E2E_WORKER_CPU="${E2E_WORKER_CPU:-1500m}" E2E_WORKER_MEMORY="${E2E_WORKER_MEMORY:-6Gi}"
else
  STEPS="${E2E_STEPS:-10}"
  E2E_HEAD_CPU="${E2E_HEAD_CPU:-1}" E2E_HEAD_MEMORY="${E2E_HEAD_MEMORY:-4Gi}"
  E2E_WORKER_CPU="${E2E_WORKER_CPU:-4}" E2E_WORKER_MEMORY="${E2E_WORKER_MEMORY:-24Gi}"
fi
export E2E_HEAD_CPU E2E_HEAD_MEMORY E2E_WORKER_CPU E2E_WORKER_MEMORY RUNTIME_IMAGE MODE

# ---- tools --------------------------------------------------------------------------------------
if [[ "$MODE" == fake ]]; then
  bash hack/docker/up.sh
  # kind, kubectl and helm at the pinned versions, built from Go modules (cached).
  TOOLS_BIN="$(bash hack/build-tools.sh | tail -n 1)"
  export PATH="$TOOLS_BIN:$PATH"
fi
need docker "a Docker engine"
need kind "https://kind.sigs.k8s.io (or hack/build-tools.sh)"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
need helm "https://helm.sh"
need python3 "for JSON checks"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (docker info)"
log "mode $MODE; cluster $CLUSTER; images $OPERATOR_IMAGE, $RUNTIME_IMAGE; KubeRay $KUBERAY_VERSION"

k() { kubectl --context "$CTX" "$@"; }
h() { helm --kube-context "$CTX" "$@"; }
stamp() { printf '%s=%s\n' "$1" "$(date +%s)" >> "$ARTIFACTS/stamps.env"; }
: > "$ARTIFACTS/stamps.env"
stamp start

# The machine's memory, sampled every 5 s while the suite runs (peak reported at the end).
( while sleep 5; do free -m | awk '/^Mem:/ {print $3}'; done ) > "$ARTIFACTS/mem-used-mib.txt" 2>/dev/null &
MEM_PID=$!

diagnose() {
  log "collecting diagnostics in $ARTIFACTS"
  {
    echo "=== nodes"; k get nodes -o wide
    echo "=== pods"; k get pods -A -o wide
    echo "=== trainergroups"; k get tg -A -o yaml
    echo "=== rayclusters"; k get raycluster -A -o yaml
    echo "=== events"; k get events -A --sort-by=.lastTimestamp
  } > "$ARTIFACTS/cluster.txt" 2>&1 || true
  k -n "$OP_NS" logs deploy/trainergroup-operator --tail=-1 > "$ARTIFACTS/operator.log" 2>&1 || true
  k -n "$KR_NS" logs deploy/kuberay-operator --tail=-1 > "$ARTIFACTS/kuberay.log" 2>&1 || true
  if k get ns kueue-system >/dev/null 2>&1; then   # phase kueue
    k -n kueue-system logs deploy/kueue-controller-manager --tail=-1 > "$ARTIFACTS/kueue.log" 2>&1 || true
    k get workloads,clusterqueues,localqueues -A -o yaml > "$ARTIFACTS/kueue-objects.yaml" 2>&1 || true
  fi
  k -n "$TG_NS" logs "job/$TG-client" --tail=-1 > "$ARTIFACTS/client.log" 2>&1 || true
  k -n "$TG_NS" logs -l "ray.io/cluster=$TG,ray.io/node-type=head" --tail=-1 > "$ARTIFACTS/ray-head.log" 2>&1 || true
  k -n "$TG_NS" logs -l "ray.io/cluster=$TG,ray.io/node-type=worker" --tail=-1 > "$ARTIFACTS/ray-workers.log" 2>&1 || true
  # the Tinker API server (phase tinker): this container's log, the one before its last
  # restart, and why it restarted
  k -n "$TG_NS" logs "deploy/$TG-tinker" --tail=-1 > "$ARTIFACTS/tinker-server.log" 2>&1 || true
  k -n "$TG_NS" logs "deploy/$TG-tinker" --previous --tail=-1 > "$ARTIFACTS/tinker-server.previous.log" 2>&1 || true
  k -n "$TG_NS" describe pod -l "trainergroup.io/tinker=$TG" > "$ARTIFACTS/tinker-server.describe.txt" 2>&1 || true
  local head
  head="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=head" -o name 2>/dev/null | head -n1)"
  if [[ -n "$head" ]]; then
    k -n "$TG_NS" exec "$head" -- bash -c 'cd /tmp/ray/session_latest/logs && tail -n 80 job-driver-*.log raylet.out gcs_server.out 2>/dev/null' \
      > "$ARTIFACTS/ray-logs.txt" 2>&1 || true
  fi
  # What explains most failures, right here in the output.
  log "pods:"; k get pods -A -o wide 2>&1 | tail -n 30 >&2 || true
  log "recent events:"; k get events -A --sort-by=.lastTimestamp 2>&1 | tail -n 25 >&2 || true
  log "TrainerGroup:"; k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.phase}{"\n"}{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}' >&2 2>/dev/null || true
  log "operator log tail:"; tail -n 25 "$ARTIFACTS/operator.log" >&2 || true
  log "Ray logs tail:"; tail -n 25 "$ARTIFACTS/ray-logs.txt" >&2 2>/dev/null || true
  if [[ -s "$ARTIFACTS/tinker-server.log" ]]; then
    log "Tinker server log tail:"; tail -n 15 "$ARTIFACTS/tinker-server.log" >&2 || true
    log "Tinker server, before its last restart:"; tail -n 15 "$ARTIFACTS/tinker-server.previous.log" >&2 || true
  fi
}
pod_cpu_report() {  # once: CPU seconds per pod and node (tests/e2e/pod_cpu.py)
  [[ -n "${POD_CPU_PID:-}" ]] || return 0
  kill "$POD_CPU_PID" 2>/dev/null || true
  POD_CPU_PID=""
  log "CPU seconds by workload and node (issue 34):"
  python3 tests/e2e/pod_cpu.py report "$ARTIFACTS/pod-cpu.json" >&2 || true
}
finish() {
  local rc=$?
  kill "$MEM_PID" 2>/dev/null || true
  pod_cpu_report  # a run that passed reported it before its last line
  if (( rc != 0 )); then diagnose; fi
  if [[ "${E2E_KEEP_CLUSTER:-0}" != 1 && -z "${E2E_STOP_AFTER:-}" ]]; then
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  else
    log "cluster kept: kubectl --context $CTX ..."
  fi
  exit "$rc"
}
wait_for() {  # <timeout s> <description> <command...>: until the command succeeds
  local timeout="$1" what="$2" t0; shift 2
  t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) - t0 < timeout )) || die "$what: not done after ${timeout}s"
    sleep 3
  done
}

# ---- 1. images ----------------------------------------------------------------------------------
if [[ "${E2E_SKIP_BUILD:-0}" != 1 ]]; then
  if [[ "$MODE" == fake ]]; then
    log "building the images from stand-in bases (hack/images/build.sh)"
    # RUNTIME_IMAGE is already the CPU variant's tag here: build.sh would add "-cpu" again
    RUNTIME_CPU_IMAGE="$RUNTIME_IMAGE" OPERATOR_IMAGE="$OPERATOR_IMAGE" KUBERAY_IMAGE="$KUBERAY_IMAGE" \
      bash hack/images/build.sh operator runtime-cpu kuberay
  else
    log "building images (make images)"
    make images OPERATOR_IMAGE="$OPERATOR_IMAGE" RUNTIME_IMAGE="$RUNTIME_IMAGE"
  fi
fi
docker image inspect "$OPERATOR_IMAGE" "$RUNTIME_IMAGE" >/dev/null \
  || die "images missing: $OPERATOR_IMAGE $RUNTIME_IMAGE (build them, or unset E2E_SKIP_BUILD)"
stamp images

# ---- 2. the kind cluster ------------------------------------------------------------------------
trap finish EXIT
if [[ "$MODE" == fake ]]; then
  log "kind cluster $CLUSTER from the locally built node image (hack/kind/cluster.sh)"
  # A fresh cluster unless asked to reuse one (a kept cluster may hold an earlier run's objects).
  [[ "${E2E_REUSE_CLUSTER:-0}" == 1 ]] || TG_KIND_CLUSTER="$CLUSTER" bash hack/kind/cluster.sh down || true
  KUBECONFIG="$(TG_KIND_CLUSTER="$CLUSTER" bash hack/kind/cluster.sh up | tail -n 1)"
  [[ -f "$KUBECONFIG" ]] || die "hack/kind/cluster.sh up printed no kubeconfig path (got '$KUBECONFIG')"
  export KUBECONFIG
  log "network check: pod to pod across the GPU and CPU nodes, a Service through DNS"
  TG_KIND_CLUSTER="$CLUSTER" TG_KIND_KUBECONFIG="$KUBECONFIG" bash hack/kind/check.sh
  GPU_NODE="$(k get nodes -l nvidia.com/gpu.present=true -o jsonpath='{.items[0].metadata.name}')"
  [[ -n "$GPU_NODE" ]] || die "no node labelled nvidia.com/gpu.present=true"
  stamp cluster
  # CPU seconds per pod and node from the host's cgroups, reported at the end (finish)
  python3 tests/e2e/pod_cpu.py sample "$ARTIFACTS/pod-cpu.json" --cluster "$CLUSTER" \
    2>"$ARTIFACTS/pod-cpu.err" &
  POD_CPU_PID=$!
  # Only the workers run our pods (the control plane keeps its NoSchedule taint): the runtime
  # image (several GB) goes to both, the operators' images to the untainted CPU worker.
  CPU_NODE="$(k get nodes -l '!nvidia.com/gpu.present,!node-role.kubernetes.io/control-plane' -o jsonpath='{.items[0].metadata.name}')"
  [[ -n "$CPU_NODE" ]] || die "no CPU worker node (a node that is neither the control plane nor labelled nvidia.com/gpu.present)"
  # (load-image.sh streams each image into one node at a time and drops the layer blobs a
  # node has unpacked, so a node holds the image's size once, not twice.)
  log "loading images into $GPU_NODE and $CPU_NODE"
  TG_KIND_CLUSTER="$CLUSTER" TG_KIND_LOAD_NODES="$GPU_NODE,$CPU_NODE" bash hack/kind/load-image.sh "$RUNTIME_IMAGE"
  TG_KIND_CLUSTER="$CLUSTER" TG_KIND_LOAD_NODES="$CPU_NODE" bash hack/kind/load-image.sh "$OPERATOR_IMAGE" "$KUBERAY_IMAGE"
else
  NODE="${CLUSTER}-control-plane"
  GPU_NODE="$NODE"
  NVDP_VERSION="${NVDP_VERSION:-0.17.1}"
  NVIDIA_CTK_VERSION="${NVIDIA_CTK_VERSION:-}"
  need nvidia-smi "NVIDIA driver"
  RUNTIME="$(docker info --format '{{.DefaultRuntime}}')"
  [[ "$RUNTIME" == nvidia ]] || die "Docker's default runtime is '$RUNTIME', not nvidia: sudo nvidia-ctk runtime configure --runtime=docker --set-as-default && sudo systemctl restart docker"
  grep -Eq '^\s*accept-nvidia-visible-devices-as-volume-mounts\s*=\s*true' /etc/nvidia-container-runtime/config.toml 2>/dev/null \
    || die "set accept-nvidia-visible-devices-as-volume-mounts=true: sudo nvidia-ctk config --set accept-nvidia-visible-devices-as-volume-mounts=true --in-place"
  kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  log "creating kind cluster $CLUSTER (${KIND_NODE_IMAGE:-kindest/node:v1.34.0})"
  kind create cluster --name "$CLUSTER" --image "${KIND_NODE_IMAGE:-kindest/node:v1.34.0}" \
    --config tests/e2e/kind-config.yaml --wait 180s
  stamp cluster
  log "NVIDIA container toolkit inside the node, as containerd's default runtime"
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
  log "loading images into the node"
  kind load docker-image "$OPERATOR_IMAGE" "$RUNTIME_IMAGE" --name "$CLUSTER"
fi
gpus_advertised() { [[ "$(k get node "$GPU_NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}')" -ge 2 ]]; }
wait_for 300 "node $GPU_NODE advertises >= 2 nvidia.com/gpu" gpus_advertised
log "node $GPU_NODE advertises $(k get node "$GPU_NODE" -o jsonpath='{.status.allocatable.nvidia\.com/gpu}') nvidia.com/gpu"
stamp loaded
if [[ "${E2E_STOP_AFTER:-}" == loaded ]]; then
  log "cluster $CLUSTER up with the images loaded: stopping here (E2E_STOP_AFTER=loaded), cluster kept"
  exit 0
fi
[[ "$MODE" == fake ]] && source tests/e2e/phases/netpol.sh   # NetworkPolicy enforcer (kube-router)

# ---- 3. KubeRay and the chart -------------------------------------------------------------------
if [[ "$MODE" == fake ]]; then
  log "KubeRay operator $KUBERAY_VERSION (image built here, chart hack/kuberay-chart)"
  KR_CHART="$(bash hack/kuberay-chart/prepare.sh "$ARTIFACTS/kuberay-chart")"
  h install kuberay-operator "$KR_CHART" --namespace "$KR_NS" --create-namespace --wait --timeout 5m \
    --set image.repository="${KUBERAY_IMAGE%:*}" --set image.tag="${KUBERAY_IMAGE##*:}" \
    --set image.pullPolicy=Never
else
  log "KubeRay operator $KUBERAY_VERSION (upstream chart)"
  h install kuberay-operator kuberay/kuberay-operator --version "${KUBERAY_VERSION#v}" \
    --namespace "$KR_NS" --create-namespace --wait --timeout 5m
fi

log "TrainerGroup chart"
k apply -f manifests/namespace.yaml   # Pod Security "restricted" for the operator
# The whole flow runs where the "restricted" Pod Security Standard is enforced (issue 36): Ray
# pods, client Jobs, probe pods, Redis. E2E_PSS=privileged (or baseline) relaxes it, e.g. to
# compare; a pod that breaks the standard is refused at creation, so its controller's events
# name the field.
PSS="${E2E_PSS:-restricted}"
k label ns "$TG_NS" --overwrite "pod-security.kubernetes.io/enforce=$PSS" \
  "pod-security.kubernetes.io/enforce-version=latest" "pod-security.kubernetes.io/warn=$PSS" >/dev/null
if [[ "$PSS" == restricted ]]; then  # the label is enforced: a root, privileged pod is refused
  if out="$(k -n "$TG_NS" run tg-pss-check --image="$RUNTIME_IMAGE" --restart=Never \
      --privileged --dry-run=server -o name 2>&1)"; then
    die "namespace $TG_NS accepted a privileged pod under enforce=restricted: $out"
  fi
  grep -q 'violates PodSecurity "restricted' <<<"$out" \
    || die "a privileged pod in $TG_NS was refused, but not by Pod Security: $out"
  log "namespace $TG_NS enforces Pod Security \"restricted\" (a privileged pod is refused)"
fi
# The chart's default gateway (gateway.mode=namespace), which phase "gateway" (a default phase)
# drives; a run whose E2E_PHASES leaves that phase out installs the chart without it.
GW_MODE=namespace
[[ -n "${E2E_PHASES+set}" && " ${E2E_PHASES} " != *" gateway "* ]] && GW_MODE=off
h install trainergroup charts/trainergroup --namespace "$OP_NS" --wait --timeout 5m \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="${OPERATOR_IMAGE##*:}" \
  --set image.pullPolicy=Never --set gateway.mode="$GW_MODE" \
  --set "clients[0].name=trainergroup-client" --set "clients[0].namespace=$TG_NS" \
  --set "clients[0].trainerGroups[0]=$TG" --set "clients[0].trainerGroups[1]=kq-trainee"
k -n "$OP_NS" rollout status deploy/trainergroup-operator --timeout=180s
stamp installed

# ---- 4. the example TrainerGroup ----------------------------------------------------------------
log "applying the example TrainerGroup (Ray pods resized for this machine)"
# fake mode: the model shrinks to what 2 CPU cores train in seconds; nvidia mode keeps it.
PATCH="$(python3 -c '
import json, os
e = os.environ.get
spec = {"image": os.environ["RUNTIME_IMAGE"], "rayCluster": {
    "head": {"cpu": e("E2E_HEAD_CPU"), "memory": e("E2E_HEAD_MEMORY")},
    "workers": {"cpu": e("E2E_WORKER_CPU"), "memory": e("E2E_WORKER_MEMORY")}}}
if os.environ["MODE"] == "fake":
    spec["model"] = {"vocabSize": 256, "hiddenSize": 64, "numLayers": 2, "numAttentionHeads": 4,
                     "ffnHiddenSize": 128, "maxSequenceLength": 64, "dtype": "bfloat16"}
    spec["training"] = {"batchSize": 8, "sequenceLength": 32}
    spec["optimizer"] = {"lr": 0.003, "clipGrad": 1.0}
    # the Tinker API server (spec.api.tinker, on by default) sized for kind on 2 cores
    spec["api"] = {"server": {"cpu": "250m", "memory": "1536Mi"}}
print(json.dumps({"spec": spec}))')"
k patch --local -f manifests/examples/trainergroup.yaml --type merge -p "$PATCH" -o yaml > "$ARTIFACTS/trainergroup.yaml"
k apply -f "$ARTIFACTS/trainergroup.yaml"
stamp applied
tg_phase() { k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.phase}'; }
tg_why() { k -n "$TG_NS" get tg "$TG" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}; {end}'; }
wait_phase() {  # <phase> <timeout s> [<jsonpath that must differ from $4>]
  local want="$1" timeout="$2" t0 phase last=""
  t0=$(date +%s)
  while :; do
    phase="$(tg_phase)"
    [[ "$phase" != "$last" ]] && { log "phase: ${phase:-<none>}"; last="$phase"; }
    [[ "$phase" == "$want" ]] && return 0
    [[ "$phase" == Failed ]] && die "TrainerGroup $TG is Failed: $(tg_why)"
    (( $(date +%s) - t0 < timeout )) || die "TrainerGroup $TG not $want after ${timeout}s (phase '$phase'): $(tg_why)"
    sleep 3
  done
}
wait_phase Ready "$READY_TIMEOUT"
stamp ready
log "TrainerGroup Ready after $(( $(date +%s) - $(sed -n 's/^applied=//p' "$ARTIFACTS/stamps.env") ))s"
k -n "$TG_NS" get tg "$TG" -o wide

check_status() {  # status assertions shared by the first Ready and the Ready after recovery
  k -n "$TG_NS" get tg "$TG" -o json | GPU_NODE="$GPU_NODE" python3 -c '
import json, os, sys
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
want_device = "cpu" if os.environ["MODE"] == "fake" else "cuda"
check(st.get("device") == want_device, f"status.device {want_device}")
check(st.get("backend") == ("gloo" if want_device == "cpu" else "nccl"), "status.backend")
print(json.dumps({"workerNames": st["workerNames"], "generation": st.get("groupGeneration"),
                  "device": st.get("device"), "restarts": st.get("restarts")}))
'
}
check_status | tee "$ARTIFACTS/status-first.json"
snapshot() {  # <name>: the objects whose timestamps tests/e2e/timeline.py reads
  { k -n "$TG_NS" get tg "$TG" -o json; k -n "$TG_NS" get raycluster "$TG" -o json
    k -n "$TG_NS" get pods -l "ray.io/cluster=$TG" -o json
    k -n "$TG_NS" get events --field-selector "involvedObject.name=$TG" -o json
  } > "$ARTIFACTS/snapshot-$1.json" 2>/dev/null || true
}
snapshot ready
k -n "$TG_NS" get raycluster "$TG" >/dev/null || die "RayCluster $TG missing"
WORKER_POD_NODE="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=worker" -o jsonpath='{.items[0].spec.nodeName}')"
[[ "$WORKER_POD_NODE" == "$GPU_NODE" ]] || die "the worker pod runs on '$WORKER_POD_NODE', not on the GPU node $GPU_NODE"

# ---- 5. the client Job --------------------------------------------------------------------------
source tests/e2e/lib/clients.sh   # e2e_client, e2e_steps, e2e_claim, e2e_ready_line (here and in the phases)
run_client() {  # <job name>: the example client Job (tests/e2e/lib/clients.sh); checks its log
  local job="$1"
  e2e_client "$job"
  STEPS="$STEPS" python3 - "$ARTIFACTS/$job.log" <<'EOF'
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
if not losses[-1] < losses[0]:
    sys.exit(f"loss did not fall: {losses}")
print(f"client OK: {want} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
EOF
}
log "client Job: $STEPS steps"
stamp client_start
run_client "$TG-client"
stamp client_done
# A normal run posts no Warning event: from the apply to here nothing was killed, so any
# Warning on the group's objects (a probe that failed, a back-off, a failed mount) is a defect.
# E2E_ALLOW_WARNINGS=1 only reports them.
no_warnings_since() {  # <epoch s>
  k -n "$TG_NS" get events --field-selector type=Warning -o json \
    | python3 tests/e2e/warnings.py --since "$1" --skip-kind Node > "$ARTIFACTS/warnings.txt" \
    && { log "no Warning event since the apply"; return 0; }
  log "Warning events during a run without faults:"; cat "$ARTIFACTS/warnings.txt" >&2
  [[ "${E2E_ALLOW_WARNINGS:-0}" == 1 ]] || die "Warning events in a run without faults ($ARTIFACTS/warnings.txt)"
}
no_warnings_since "$(sed -n 's/^applied=//p' "$ARTIFACTS/stamps.env" | tail -n 1)"
source tests/e2e/phases/security.sh   # token auth and NetworkPolicy, seen from probe pods

# ---- 6. the operator runs as a real pod ---------------------------------------------------------
OP_POD="$(k -n "$OP_NS" get pod -l app.kubernetes.io/component=operator -o jsonpath='{.items[0].metadata.name}')"
[[ -n "$OP_POD" ]] || die "no operator pod in $OP_NS"
k -n "$OP_NS" get pod "$OP_POD" -o json | python3 -c '
import json, sys
pod = json.load(sys.stdin); c = pod["spec"]["containers"][0]; s = pod["status"]["containerStatuses"][0]
sc = c.get("securityContext", {})
assert s["ready"] and s["restartCount"] == 0, f"operator not ready or restarted: {s}"
assert sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False, sc
assert c.get("livenessProbe"), "no liveness probe"
print("operator pod OK: ready, 0 restarts, read-only root, liveness probe", c["livenessProbe"].get("httpGet"))
'
METRICS_SVC="$(k -n "$OP_NS" get svc -l app.kubernetes.io/component=operator -o jsonpath='{.items[0].metadata.name}')"
k get --raw "/api/v1/namespaces/$OP_NS/services/http:$METRICS_SVC:metrics/proxy/metrics" > "$ARTIFACTS/metrics.txt" \
  || die "cannot scrape the operator's metrics through Service $METRICS_SVC"
grep -q '^tg_operator_reconciles_total' "$ARTIFACTS/metrics.txt" || die "no tg_operator_reconciles_total in the scrape ($ARTIFACTS/metrics.txt)"
log "operator metrics scraped: $(grep -c '^tg_operator_' "$ARTIFACTS/metrics.txt") tg_operator_ samples"
# Training progress in real pods: rank 0's progress file on its worker pod, read by the operator
# through the dashboard's log API, reaches status.training and the per-group gauges within a few
# health ticks of the client's last step (docs/operator.md).
training_at_last_step() {
  [[ "$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.training.step}' 2>/dev/null)" == "$STEPS" ]]
}
wait_for 120 "status.training.step = $STEPS (the client's last step)" training_at_last_step
log "status.training: $(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.training}'); Training condition: $(k -n "$TG_NS" get tg "$TG" -o jsonpath='{range .status.conditions[?(@.type=="Training")]}{.status} {.reason}{end}')"
k get --raw "/api/v1/namespaces/$OP_NS/services/http:$METRICS_SVC:metrics/proxy/metrics" > "$ARTIFACTS/metrics.txt" \
  || die "cannot scrape the operator's metrics through Service $METRICS_SVC"
grep -qxF "trainergroup_training_step{name=\"$TG\",namespace=\"$TG_NS\"} $STEPS.0" "$ARTIFACTS/metrics.txt" \
  || die "no trainergroup_training_step gauge of $STEPS for $TG_NS/$TG in the scrape ($ARTIFACTS/metrics.txt)"

# ---- 7. a worker pod dies: Degraded, then Ready under new names ---------------------------------
# The chaos fault worker-killed-mid-step checks the same and more (Degraded seen, Ready under new
# names, the ALIVE actors are the status's names, resumed from the newest checkpoint, a client
# trains after it, its first loss continues the checkpoint's): when it runs, step 7 and the
# resume phase are left out (docs/testing.md, "Merged").
CHAOS_COVERS_KILL=0
if [[ "${E2E_CHAOS:-0}" == 1 ]] && [[ -z "${E2E_CHAOS_FAULTS:-}" || ",${E2E_CHAOS_FAULTS}," == *",worker-killed-mid-step,"* || ",${E2E_CHAOS_FAULTS}," == *",worker-and-operator-killed,"* ]]; then
  CHAOS_COVERS_KILL=1
fi
if (( CHAOS_COVERS_KILL )); then
  log "step 7 (a worker pod dies) and the resume phase: covered by the chaos fault that kills a worker mid-step below"
else
OLD_NAMES="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.workerNames}')"
WPOD="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=worker" -o jsonpath='{.items[0].metadata.name}')"
log "deleting worker pod $WPOD"
stamp kill_worker
k -n "$TG_NS" delete pod "$WPOD" --wait=false
wait_phase Degraded 300
stamp degraded
k -n "$TG_NS" get tg "$TG" -o jsonpath='{range .status.conditions[?(@.type=="Degraded")]}{.reason}: {.message}{"\n"}{end}'
wait_phase Ready "$READY_TIMEOUT"
stamp recovered
snapshot recovered
NEW_NAMES="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.workerNames}')"
[[ "$NEW_NAMES" != "$OLD_NAMES" ]] || die "Ready again but the worker names did not change: $NEW_NAMES"
check_status | tee "$ARTIFACTS/status-recovered.json"
log "recovered under new names $NEW_NAMES (were $OLD_NAMES)"
run_client "$TG-client-2"
fi
DEFAULT_PHASES="resume tinker gateway tls"; (( CHAOS_COVERS_KILL )) && DEFAULT_PHASES="tinker gateway tls"
# shellcheck source=/dev/null  # ---- phases: tests/e2e/phases/<name>.sh, each from a Ready group
for phase in ${E2E_PHASES-$DEFAULT_PHASES}; do source "tests/e2e/phases/$phase.sh"; done
[[ "${E2E_CHAOS:-0}" == 1 ]] && source tests/e2e/phases/chaos.sh   # opt-in: docs/chaos.md

# ---- 8. deletion leaves nothing behind ----------------------------------------------------------
log "deleting the TrainerGroup"
stamp delete
k -n "$TG_NS" delete job "$TG-client" "$TG-client-2" --wait=false --ignore-not-found
k -n "$TG_NS" delete tg "$TG" --timeout=600s
LEFT=""
for _ in $(seq 100); do
  LEFT="$(k -n "$TG_NS" get raycluster,pods -l "ray.io/cluster=$TG" -o name 2>/dev/null; k -n "$TG_NS" get raycluster "$TG" -o name 2>/dev/null || true)"
  [[ -z "$LEFT" ]] && break
  sleep 3
done
[[ -z "$LEFT" ]] || die "left behind after deletion: $LEFT"
stamp deleted
CLEANED="$(k -n "$TG_NS" get events --field-selector "involvedObject.name=$TG,reason=CleanedUp" -o jsonpath='{.items[-1:].message}')"
log "operator's CleanedUp event: $CLEANED"
[[ "$CLEANED" == *"no live workers left"* ]] || die "no CleanedUp event saying the workers are gone (got '$CLEANED')"
# Kueue admits, queues and preempts; its quota is held by the GCS fault-tolerance group.
KQ_ON=0; [[ "${E2E_KUEUE:-$([[ "$MODE" == fake ]] && echo 1 || echo 0)}" == 1 ]] && KQ_ON=1
(( KQ_ON )) && source tests/e2e/phases/kueue.sh
source tests/e2e/phases/gcs_ft.sh   # GCS fault tolerance: the head pod dies, the workers live on

# ---- record -------------------------------------------------------------------------------------
python3 tests/e2e/timeline.py "$ARTIFACTS" | tee "$ARTIFACTS/timeline.txt"
log "all checks passed in $(( $(date +%s) - T_START ))s"
pod_cpu_report  # before the last line: "E2E PASSED" must end the output (test_e2e_kind.py)
echo "E2E PASSED"
