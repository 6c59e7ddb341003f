# shellcheck shell=bash
# Phase "kueue" of tests/e2e/run.sh (sourced after the first groups are deleted, E2E_KUEUE=1):
# Kueue itself, built here, admits TrainerGroups by GPU quota, all or nothing, and preempts.
#
#   1. Kueue's manager go-built (hack/kueue/build.sh), packaged (hack/images/build.sh kueue),
#      loaded into the CPU node, installed with its own Helm chart (from its Go module; the
#      RayCluster integration is in the chart's default frameworks);
#   2. a ClusterQueue whose GPU quota (2) fits one group, preemption of lower priorities within
#      it, a LocalQueue, and WorkloadPriorityClasses low / high;
#   3. group $KQ_HOLDER (low) is admitted and becomes Ready; group $TG (low, with a checkpoint
#      claim) is applied and stays Queued, its RayCluster suspended, with no pod at all (no
#      partial placement) while the first one holds the quota;
#   4. $KQ_HOLDER is deleted: $TG is admitted, becomes Ready, and a client trains it and saves a
#      checkpoint;
#   5. group $KQ_URGENT (high) is applied: Kueue preempts $TG, which goes back to Queued (its
#      pods gone); $KQ_URGENT becomes Ready;
#   6. $KQ_URGENT is deleted: $TG is admitted again, its re-created group resumes from the
#      checkpoint (restartPolicy OnFailure), and the next client's steps continue.
#
# Uses run.sh's k, h, log, die, wait_for, stamp, TG, TG_NS, GPU_NODE, CPU_NODE, CLUSTER, MODE,
# STEPS, ARTIFACTS, READY_TIMEOUT and tests/e2e/lib/clients.sh's e2e_*; defines only kq_* / KQ_* names.
# Figures go to $ARTIFACTS/kueue.json.

KQ_T0=$(date +%s)
# shellcheck source=../../../hack/kueue/version.env
source hack/kueue/version.env
KQ_IMAGE="trainergroup.local/kueue:$KUEUE_VERSION"
KQ_NS=kueue-system
KQ_CQ=tg-e2e-cq
KQ_LQ=team-a
KQ_HOLDER=kq-holder
KQ_URGENT=kq-urgent
KQ_CLAIM="tg-kq-ckpt-$KQ_T0"
KQ_MOUNT=/checkpoints
KQ_CKPT="$KQ_MOUNT/$TG/step_$(printf '%08d' "$STEPS")"
log "phase kueue: Kueue $KUEUE_VERSION built here ($KQ_IMAGE)"
stamp kueue_start

# ---- 1. Kueue -----------------------------------------------------------------------------------
bash hack/images/build.sh kueue >/dev/null 2> "$ARTIFACTS/kueue-build.log" \
  || { tail -n 30 "$ARTIFACTS/kueue-build.log" >&2; die "building Kueue's image failed"; }
if [[ "$MODE" == fake ]]; then
  TG_KIND_CLUSTER="$CLUSTER" TG_KIND_LOAD_NODES="$CPU_NODE" bash hack/kind/load-image.sh "$KQ_IMAGE"
else
  kind load docker-image "$KQ_IMAGE" --name "$CLUSTER"
fi
KQ_SRC="$(bash hack/kueue/source.sh | tail -n 1)"
h install kueue "$KQ_SRC/charts/kueue" --namespace "$KQ_NS" --create-namespace --wait --timeout 5m \
  --set controllerManager.manager.image.repository="${KQ_IMAGE%:*}" \
  --set controllerManager.manager.image.tag="${KQ_IMAGE##*:}" \
  --set controllerManager.manager.image.pullPolicy=Never \
  --set controllerManager.manager.resources.requests.cpu=100m \
  --set controllerManager.manager.resources.requests.memory=256Mi >/dev/null
k -n "$KQ_NS" rollout status deploy/kueue-controller-manager --timeout=300s >/dev/null
stamp kueue_installed
log "Kueue running in $KQ_NS after $(( $(date +%s) - KQ_T0 ))s"

# ---- 2. quota: one group's GPUs; preemption of lower priorities ---------------------------------
# The webhook answers only once Kueue's own certificate is in place: retry the first objects.
kq_queues() {
  k apply -f - <<EOF
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: tg-e2e-flavor}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: $KQ_CQ}
spec:
  namespaceSelector: {}
  preemption: {withinClusterQueue: LowerPriority}
  resourceGroups:
    - coveredResources: [cpu, memory, nvidia.com/gpu]
      flavors:
        - name: tg-e2e-flavor
          resources:
            - {name: cpu, nominalQuota: "64"}
            - {name: memory, nominalQuota: 512Gi}
            - {name: nvidia.com/gpu, nominalQuota: "2"}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: $KQ_LQ, namespace: $TG_NS}
spec: {clusterQueue: $KQ_CQ}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata: {name: low}
value: 100
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata: {name: high}
value: 1000
EOF
}
wait_for 120 "Kueue's queues created (its webhook serving)" kq_queues
kq_cq_active() { [[ "$(k get clusterqueue "$KQ_CQ" -o jsonpath='{.status.conditions[?(@.type=="Active")].status}')" == True ]]; }
wait_for 120 "ClusterQueue $KQ_CQ Active" kq_cq_active

# ---- groups -------------------------------------------------------------------------------------
e2e_claim "$KQ_CLAIM" "tg-e2e-kq-ckpt-$KQ_T0" "/var/lib/tg-e2e/kq-ckpt-$KQ_T0"
kq_apply() {  # <name> <priority class> [storage]: the example group, queued, Tinker server off
  local name="$1" prio="$2" storage="${3:-}"
  NAME="$name" PRIO="$prio" LQ="$KQ_LQ" STORAGE="$storage" CLAIM="$KQ_CLAIM" MOUNT="$KQ_MOUNT" \
    python3 - "$ARTIFACTS/trainergroup.yaml" > "$ARTIFACTS/kueue-$name.yaml" <<'PY'
import os, sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
e = os.environ
doc["metadata"] = {"name": e["NAME"], "namespace": doc["metadata"].get("namespace", "default")}
spec = doc["spec"]
spec["queue"] = {"name": e["LQ"], "priorityClass": e["PRIO"]}
spec.setdefault("api", {})["tinker"] = False
if e["STORAGE"]:
    spec["rayCluster"]["storage"] = {"claimName": e["CLAIM"], "mountPath": e["MOUNT"]}
    spec.setdefault("training", {})["checkpointDir"] = f"{e['MOUNT']}/{e['NAME']}"
yaml.safe_dump(doc, sys.stdout, sort_keys=False)
PY
  k apply -f "$ARTIFACTS/kueue-$name.yaml" >/dev/null
}
kq_phase() { k -n "$TG_NS" get tg "$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
kq_is() { [[ "$(kq_phase "$1")" == "$2" ]]; }
kq_wait() {  # <name> <phase> <timeout s>: fails at once on Failed
  local name="$1" want="$2" timeout="$3" t0 p
  t0=$(date +%s)
  while :; do
    p="$(kq_phase "$name")"
    [[ "$p" == "$want" ]] && return 0
    [[ "$p" == Failed ]] && die "TrainerGroup $name is Failed: $(k -n "$TG_NS" get tg "$name" -o jsonpath='{.status.message}')"
    (( $(date +%s) - t0 < timeout )) || die "TrainerGroup $name not $want after ${timeout}s (phase '$p'): $(k -n "$TG_NS" get tg "$name" -o jsonpath='{.status.message}')"
    sleep 3
  done
}
kq_pods() { k -n "$TG_NS" get pods -l "ray.io/cluster=$1" -o name 2>/dev/null; }
kq_no_pods() { [[ -z "$(kq_pods "$1")" ]]; }
kq_suspended() { [[ "$(k -n "$TG_NS" get raycluster "$1" -o jsonpath='{.spec.suspend}')" == true ]]; }
kq_gone() { ! k -n "$TG_NS" get tg "$1" >/dev/null 2>&1 && kq_no_pods "$1"; }
kq_queued_holding_nothing() {  # <name> <seconds>: Queued, suspended, and no pod, the whole time
  local name="$1" t_end=$(( $(date +%s) + $2 ))
  while (( $(date +%s) < t_end )); do
    kq_is "$name" Queued || die "$name left Queued while the quota is held (phase '$(kq_phase "$name")')"
    kq_suspended "$name" || die "the RayCluster $name is not suspended while queued"
    kq_no_pods "$name" || die "a queued group has pods (partial placement): $(kq_pods "$name" | tr '\n' ' ')"
    sleep 3
  done
}

# ---- 3. the first group holds the quota; the second waits, holding nothing ----------------------
# the last group named $TG (gcs_ft) was just deleted: its token Secret must be collected first
kq_secret_gone() { ! k -n "$TG_NS" get secret "$TG-ray-token" >/dev/null 2>&1; }
wait_for 120 "the deleted group's Secret garbage-collected" kq_secret_gone
# and its RayCluster (KubeRay's GCS FT cleanup finalizer holds it a while): a new group of the
# same name would find it and fail with ClusterConflict (seen on kind at 19:13)
kq_cluster_gone() { ! k -n "$TG_NS" get raycluster "$TG" >/dev/null 2>&1; }
wait_for 600 "the deleted group's RayCluster gone" kq_cluster_gone
kq_apply "$KQ_HOLDER" low
kq_wait "$KQ_HOLDER" Ready "$READY_TIMEOUT"
stamp kueue_first_ready
kq_apply "$TG" low storage
kq_wait "$TG" Queued 120
kq_queued_holding_nothing "$TG" 30
KQ_MSG="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.message}')"
[[ "$KQ_MSG" == *"LocalQueue $KQ_LQ"* ]] || die "the queued group's message does not name its queue: $KQ_MSG"
log "second group Queued, no pod: $KQ_MSG"
kq_is "$KQ_HOLDER" Ready || die "$KQ_HOLDER left Ready while $TG waited"

# ---- 4. the quota frees: the second group is admitted, Ready, and trains ------------------------
k -n "$TG_NS" delete tg "$KQ_HOLDER" --wait=false >/dev/null
KQ_FREED=$(date +%s)
kq_wait "$TG" Ready "$READY_TIMEOUT"
KQ_ADMITTED_READY=$(( $(date +%s) - KQ_FREED ))
stamp kueue_second_ready
log "$TG admitted and Ready ${KQ_ADMITTED_READY}s after the quota was freed"
wait_for 300 "$KQ_HOLDER gone with its pods" kq_gone "$KQ_HOLDER"
e2e_client "$TG-kq-a" --save-checkpoint "$KQ_CKPT"
grep -q "checkpoint saved to $KQ_CKPT" "$ARTIFACTS/$TG-kq-a.log" \
  || die "client $TG-kq-a did not report the checkpoint $KQ_CKPT"

# ---- 5. a higher priority preempts it: back to Queued ------------------------------------------
KQ_NAMES_BEFORE="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.workerNames}')"
kq_apply "$KQ_URGENT" high
KQ_PREEMPT_T=$(date +%s)
kq_wait "$TG" Queued 300
wait_for 300 "the preempted group's pods gone" kq_no_pods "$TG"
stamp kueue_preempted
KQ_MSG_PREEMPTED="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.message}')"
log "$TG preempted: Queued again, no pod: $KQ_MSG_PREEMPTED"
kq_wait "$KQ_URGENT" Ready "$READY_TIMEOUT"
KQ_URGENT_READY=$(( $(date +%s) - KQ_PREEMPT_T ))
kq_is "$TG" Queued || die "$TG left Queued while $KQ_URGENT holds the quota"

# ---- 6. the quota frees again: re-admitted, the group resumes from its checkpoint --------------
k -n "$TG_NS" delete tg "$KQ_URGENT" --wait=false >/dev/null
KQ_FREED=$(date +%s)
kq_wait "$TG" Ready "$READY_TIMEOUT"
KQ_READMITTED_READY=$(( $(date +%s) - KQ_FREED ))
stamp kueue_resumed
KQ_NAMES_AFTER="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.workerNames}')"
[[ "$KQ_NAMES_AFTER" != "$KQ_NAMES_BEFORE" ]] || die "re-admitted under the same worker names: the group was not re-created"
KQ_READY_LINE="$(e2e_ready_line)"
log "server after re-admission: $KQ_READY_LINE"
wait_for 300 "$KQ_URGENT gone with its pods" kq_gone "$KQ_URGENT"
e2e_client "$TG-kq-b"
A="$(e2e_steps "$TG-kq-a")" B="$(e2e_steps "$TG-kq-b")" READY="$KQ_READY_LINE" CKPT="$KQ_CKPT" \
  STEPS="$STEPS" T_ADMIT="$KQ_ADMITTED_READY" T_URGENT="$KQ_URGENT_READY" T_READMIT="$KQ_READMITTED_READY" \
  SECONDS_="$(( $(date +%s) - KQ_T0 ))" python3 - <<'PY' | tee "$ARTIFACTS/kueue.json"
import json, os, sys
a, b, ready = json.loads(os.environ["A"]), json.loads(os.environ["B"]), json.loads(os.environ["READY"])
n, ckpt = int(os.environ["STEPS"]), os.environ["CKPT"]
def check(ok, what):
    if not ok:
        sys.exit(f"kueue check failed: {what}\n before: {a}\n after: {b}\n ready: {ready}")
check([s["optimizerStep"] for s in a] == list(range(1, n + 1)), f"the first client trains steps 1..{n}")
check(ready.get("resumedFrom") == ckpt and ready.get("resumedStep") == n,
      f"the re-admitted group resumed from {ckpt} at step {n}")
check([s["optimizerStep"] for s in b] == list(range(n + 1, 2 * n + 1)),
      f"the next client's steps continue: {n + 1}..{2 * n}")
print(json.dumps({"admitted_to_ready_s": int(os.environ["T_ADMIT"]),
                  "preemptor_ready_s": int(os.environ["T_URGENT"]),
                  "readmitted_to_ready_s": int(os.environ["T_READMIT"]),
                  "resumedFrom": ready["resumedFrom"], "steps_after": [b[0]["optimizerStep"], b[-1]["optimizerStep"]],
                  "phase_seconds": int(os.environ["SECONDS_"])}))
PY
k -n "$TG_NS" delete job "$TG-kq-a" "$TG-kq-b" --wait=false --ignore-not-found >/dev/null
k -n "$TG_NS" delete tg "$TG" --timeout=600s >/dev/null
wait_for 300 "$TG gone with its pods" kq_gone "$TG"
stamp kueue_done
# Kueue leaves with its queues: the kept cluster's next run must not meet its webhooks (which
# refuse RayClusters while no Kueue pod answers) or spend CPU on its manager.
k delete localqueue -n "$TG_NS" "$KQ_LQ" --ignore-not-found >/dev/null
k delete clusterqueue "$KQ_CQ" --ignore-not-found >/dev/null
k delete resourceflavor tg-e2e-flavor --ignore-not-found >/dev/null
k delete workloadpriorityclass low high --ignore-not-found >/dev/null
h uninstall kueue --namespace "$KQ_NS" --wait --timeout 5m >/dev/null
k delete namespace "$KQ_NS" --ignore-not-found --wait=false >/dev/null
log "phase kueue passed in $(( $(date +%s) - KQ_T0 ))s (Kueue uninstalled)"
