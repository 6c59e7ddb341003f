# shellcheck shell=bash
# Phase "kueue" of tests/e2e/run.sh (E2E_KUEUE=1, the default in fake mode): Kueue itself, built
# here, admits TrainerGroups by GPU quota, all or nothing, and preempts. It rides on the GCS
# fault-tolerance phase (tests/e2e/phases/gcs_ft.sh): that phase's group, queued at low priority,
# is the one that holds the quota, so no group is started only to hold it.
#
# Sourced just before gcs_ft.sh, it installs Kueue and the queues and defines the hooks gcs_ft.sh
# calls:
#   1. (now) Kueue's manager go-built (hack/kueue/build.sh), packaged (hack/images/build.sh
#      kueue), loaded into the CPU node and installed with its own Helm chart (from its Go
#      module; hack/kueue/values.yaml enables only the RayCluster integration); a ClusterQueue
#      whose GPU quota (2) fits one group, with preemption of lower priorities within it, a
#      LocalQueue, and WorkloadPriorityClasses low / high;
#   2. kq_trainee_apply, once gcs_ft's group is Ready: group $KQ_TRAINEE (low, with a checkpoint
#      claim) is applied and stays Queued, its RayCluster suspended, while a pod watch runs;
#      beside it, two bad inputs: a group in a LocalQueue that does not exist, and one with a
#      WorkloadPriorityClass that does not exist;
#   3. kq_trainee_waited, just before gcs_ft deletes its group: still Queued and suspended, and
#      the watch saw no pod of it at all (no partial placement); each bad input is Queued with
#      a message that names what is missing, its RayCluster suspended and no pod; both deleted;
#   4. kq_after_holder, once gcs_ft has deleted its group: $KQ_TRAINEE is admitted, becomes
#      Ready (the time split into admission, pods and Ray), and a client trains it and saves a
#      checkpoint; group $KQ_URGENT (high) preempts it back to Queued (its pods gone) and is
#      placed; $KQ_URGENT is deleted, $KQ_TRAINEE is admitted again, its re-created group
#      resumes from the checkpoint (restartPolicy OnFailure), and the next client's steps
#      continue.
#
# Uses run.sh's k, h, log, die, wait_for, stamp, TG, TG_NS, GPU_NODE, CPU_NODE, CLUSTER, MODE,
# STEPS, ARTIFACTS, READY_TIMEOUT and tests/e2e/lib/clients.sh's e2e_*; defines only kq_* / KQ_*
# names. Figures go to $ARTIFACTS/kueue.json.

KQ_T0=$(date +%s)
# shellcheck source=../../../hack/kueue/version.env
source hack/kueue/version.env
KQ_IMAGE="trainergroup.local/kueue:$KUEUE_VERSION"
KQ_NS=kueue-system
KQ_CQ=tg-e2e-cq
KQ_LQ=team-a
KQ_TRAINEE=kq-trainee   # the chart's client RBAC (run.sh) names it beside $TG
KQ_URGENT=kq-urgent
KQ_BAD_QUEUE=kq-bad-queue   # spec.queue.name: no-such-queue
KQ_BAD_PRIO=kq-bad-prio     # spec.queue.priorityClass: no-such-class
KQ_CLAIM="tg-kq-ckpt-$KQ_T0"
KQ_MOUNT=/checkpoints
KQ_CKPT="$KQ_MOUNT/$KQ_TRAINEE/step_$(printf '%08d' "$STEPS")"
KQ_WATCH_PID=""
log "phase kueue: Kueue $KUEUE_VERSION built here ($KQ_IMAGE)"
stamp kueue_start

# ---- 1. Kueue and the queues --------------------------------------------------------------------
# The binary is cached by version; tools/test.sh starts its (cold: long) build early, and
# hack/kueue/build.sh waits on that build's lock rather than starting a second one.
bash hack/images/build.sh kueue >/dev/null 2> "$ARTIFACTS/kueue-build.log" \
  || { tail -n 30 "$ARTIFACTS/kueue-build.log" >&2; die "building Kueue's image failed"; }
if [[ "$MODE" == fake ]]; then
  TG_KIND_CLUSTER="$CLUSTER" TG_KIND_LOAD_NODES="$CPU_NODE" bash hack/kind/load-image.sh "$KQ_IMAGE"
else
  kind load docker-image "$KQ_IMAGE" --name "$CLUSTER"
fi
KQ_SRC="$(bash hack/kueue/source.sh | tail -n 1)"
h upgrade --install kueue "$KQ_SRC/charts/kueue" --namespace "$KQ_NS" --create-namespace \
  --wait --timeout 5m -f hack/kueue/values.yaml \
  --set controllerManager.manager.image.repository="${KQ_IMAGE%:*}" \
  --set controllerManager.manager.image.tag="${KQ_IMAGE##*:}" \
  --set controllerManager.manager.image.pullPolicy=Never \
  --set controllerManager.manager.resources.requests.cpu=100m \
  --set controllerManager.manager.resources.requests.memory=256Mi >/dev/null
k -n "$KQ_NS" rollout status deploy/kueue-controller-manager --timeout=300s >/dev/null
stamp kueue_installed
log "Kueue running in $KQ_NS after $(( $(date +%s) - KQ_T0 ))s"

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
e2e_claim "$KQ_CLAIM" "tg-e2e-kq-ckpt-$KQ_T0" "kq-ckpt-$KQ_T0"
stamp kueue_queues
log "Kueue and its queues ready after $(( $(date +%s) - KQ_T0 ))s"

# ---- helpers ------------------------------------------------------------------------------------
kq_queue_patch() {  # <priority class>: the merge patch that queues a group in $KQ_LQ
  printf '{"spec":{"queue":{"name":"%s","priorityClass":"%s"}}}' "$KQ_LQ" "$1"
}
kq_apply() {  # <name> <priority class> [storage] [queue]: the example group, queued, Tinker server off
  local name="$1" prio="$2" storage="${3:-}" lq="${4:-$KQ_LQ}"
  NAME="$name" PRIO="$prio" LQ="$lq" STORAGE="$storage" CLAIM="$KQ_CLAIM" MOUNT="$KQ_MOUNT" \
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
kq_message() { k -n "$TG_NS" get tg "$1" -o jsonpath='{.status.message}'; }
kq_wait() {  # <name> <phase> <timeout s>: fails at once on Failed
  local name="$1" want="$2" timeout="$3" t0 p
  t0=$(date +%s)
  while :; do
    p="$(kq_phase "$name")"
    [[ "$p" == "$want" ]] && return 0
    [[ "$p" == Failed ]] && die "TrainerGroup $name is Failed: $(kq_message "$name")"
    (( $(date +%s) - t0 < timeout )) || die "TrainerGroup $name not $want after ${timeout}s (phase '$p'): $(kq_message "$name")"
    sleep 2
  done
}
kq_pods() { k -n "$TG_NS" get pods -l "ray.io/cluster=$1" -o name 2>/dev/null; }
kq_no_pods() { [[ -z "$(kq_pods "$1")" ]]; }
kq_pods_running() {  # <name> <count>: that many pods of the group, all Running
  local phases
  phases="$(k -n "$TG_NS" get pods -l "ray.io/cluster=$1" -o jsonpath='{range .items[*]}{.status.phase}{"\n"}{end}')"
  [[ "$(grep -c . <<< "$phases")" == "$2" && "$(grep -c '^Running$' <<< "$phases")" == "$2" ]]
}
kq_suspended() { [[ "$(k -n "$TG_NS" get raycluster "$1" -o jsonpath='{.spec.suspend}')" == true ]]; }
kq_split() {  # <name> <epoch the quota was freed>: JSON of the time to Ready, split by its parts
  local uid
  uid="$(k -n "$TG_NS" get raycluster "$1" -o jsonpath='{.metadata.uid}')"
  { k -n "$TG_NS" get workloads -l "kueue.x-k8s.io/job-uid=$uid" -o json
    k -n "$TG_NS" get pods -l "ray.io/cluster=$1" -o json
    k -n "$TG_NS" get tg "$1" -o json
  } > "$ARTIFACTS/kueue-split-$1.json"
  FREED="$2" python3 - "$ARTIFACTS/kueue-split-$1.json" <<'PY'
import json, os, sys
from pathlib import Path
sys.path.insert(0, "tests/e2e")
from timeline import _docs, _t  # kubectl's concatenated documents; its time stamps
workloads, pods, tg = _docs(Path(sys.argv[1]))
def t(v): return _t(v) or 0.0
def cond(obj, ctype):
    return next(t(c["lastTransitionTime"]) for c in obj["status"]["conditions"] if c["type"] == ctype and c["status"] == "True")
freed = float(os.environ["FREED"])
admitted = cond(workloads["items"][0], "Admitted")
created = min(t(p["metadata"]["creationTimestamp"]) for p in pods["items"])
pods_ready = max(cond(p, "Ready") for p in pods["items"])
ready = cond(tg, "WorkersReady")
print(json.dumps({"admission_s": round(admitted - freed), "pods_created_s": round(created - admitted),
                  "pods_s": round(pods_ready - admitted), "ray_s": round(ready - pods_ready),
                  "total_s": round(ready - freed)}))
PY
}

# ---- 2. (gcs_ft.sh, its group Ready) the trainee is applied and waits, holding nothing --------
kq_trainee_apply() {
  KQ_HOLDER="$TG"
  kq_is "$KQ_HOLDER" Ready || die "the quota holder $KQ_HOLDER is not Ready"
  # every pod event of the queued groups while they wait: none may come
  k -n "$TG_NS" get pods -l "ray.io/cluster in ($KQ_TRAINEE,$KQ_BAD_QUEUE,$KQ_BAD_PRIO)" --watch -o name \
    > "$ARTIFACTS/kueue-queued-pods.txt" 2> "$ARTIFACTS/kueue-queued-pods.err" &
  KQ_WATCH_PID=$!
  kq_apply "$KQ_TRAINEE" low storage
  kq_apply "$KQ_BAD_QUEUE" low "" no-such-queue
  kq_apply "$KQ_BAD_PRIO" no-such-class
  KQ_QUEUED_T=$(date +%s)
  kq_wait "$KQ_TRAINEE" Queued 120
  kq_suspended "$KQ_TRAINEE" || die "the RayCluster $KQ_TRAINEE is not suspended while queued"
  log "$KQ_TRAINEE Queued behind $KQ_HOLDER: $(kq_message "$KQ_TRAINEE")"
}

# ---- 3. (gcs_ft.sh, before it deletes its group) it waited all along, with no pod -------------
kq_trainee_waited() {
  local msg
  kq_is "$KQ_TRAINEE" Queued || die "$KQ_TRAINEE left Queued while the quota is held (phase '$(kq_phase "$KQ_TRAINEE")')"
  kq_suspended "$KQ_TRAINEE" || die "the RayCluster $KQ_TRAINEE is not suspended while queued"
  kill "$KQ_WATCH_PID" 2>/dev/null; wait "$KQ_WATCH_PID" 2>/dev/null || true
  kq_no_pods "$KQ_TRAINEE" && [[ ! -s "$ARTIFACTS/kueue-queued-pods.txt" ]] \
    || die "a queued group had pods (partial placement): $(sort -u "$ARTIFACTS/kueue-queued-pods.txt" | tr '\n' ' ')"
  msg="$(kq_message "$KQ_TRAINEE")"
  [[ "$msg" == *"LocalQueue $KQ_LQ"* && "$msg" == *"Workload "* ]] \
    || die "the queued group's message names neither its queue nor its Workload: $msg"
  # bad inputs: Queued (the admin may still create what is missing), the message says what is
  # missing, and nothing but the suspended cluster exists
  local bad want
  for bad in "$KQ_BAD_QUEUE" "$KQ_BAD_PRIO"; do
    want="LocalQueue no-such-queue doesn't exist"   # Kueue's own words, through its Workload
    [[ "$bad" == "$KQ_BAD_PRIO" ]] && want="WorkloadPriorityClass no-such-class does not exist"
    kq_is "$bad" Queued || die "$bad is not Queued (phase '$(kq_phase "$bad")'): $(kq_message "$bad")"
    kq_suspended "$bad" || die "the RayCluster $bad is not suspended"
    msg="$(kq_message "$bad")"
    [[ "$msg" == *"$want"* ]] || die "$bad's message does not say '$want': $msg"
    log "bad input $bad: Queued, suspended, no pod: $msg"
  done
  k -n "$TG_NS" delete tg "$KQ_BAD_QUEUE" "$KQ_BAD_PRIO" --wait=false >/dev/null
  KQ_HELD_S=$(( $(date +%s) - KQ_QUEUED_T ))
  log "$KQ_TRAINEE waited ${KQ_HELD_S}s while $KQ_HOLDER trained and lost its head: Queued, suspended, no pod"
}

# ---- 4. (gcs_ft.sh, its group deleted at $1) admitted, trains, preempted, resumes --------------
kq_after_holder() {  # <epoch the holder's delete was issued>
  local freed="$1" split_admit split_readmit names_before names_after ready_line urgent_t
  kq_wait "$KQ_TRAINEE" Ready "$READY_TIMEOUT"
  stamp kueue_admitted_ready
  split_admit="$(kq_split "$KQ_TRAINEE" "$freed")"
  log "$KQ_TRAINEE admitted and Ready after $KQ_HOLDER's delete: $split_admit"
  E2E_GROUP="$KQ_TRAINEE" e2e_client "$KQ_TRAINEE-a" --save-checkpoint "$KQ_CKPT"
  grep -q "checkpoint saved to $KQ_CKPT" "$ARTIFACTS/$KQ_TRAINEE-a.log" \
    || die "client $KQ_TRAINEE-a did not report the checkpoint $KQ_CKPT"

  # a higher priority preempts it: back to Queued, its pods gone, and the preemptor placed
  names_before="$(k -n "$TG_NS" get tg "$KQ_TRAINEE" -o jsonpath='{.status.workerNames}')"
  kq_apply "$KQ_URGENT" high
  urgent_t=$(date +%s)
  kq_wait "$KQ_TRAINEE" Queued 300
  wait_for 300 "the preempted group's pods gone" kq_no_pods "$KQ_TRAINEE"
  stamp kueue_preempted
  log "$KQ_TRAINEE preempted: Queued again, no pod: $(kq_message "$KQ_TRAINEE")"
  wait_for 300 "$KQ_URGENT's head and worker pods Running" kq_pods_running "$KQ_URGENT" 2
  KQ_URGENT_PLACED=$(( $(date +%s) - urgent_t ))
  kq_is "$KQ_TRAINEE" Queued || die "$KQ_TRAINEE left Queued while $KQ_URGENT holds the quota"
  log "$KQ_URGENT placed ${KQ_URGENT_PLACED}s after its apply"

  # the quota frees again: re-admitted, the re-created group resumes from its checkpoint
  k -n "$TG_NS" delete tg "$KQ_URGENT" --wait=false >/dev/null
  freed=$(date +%s)
  kq_wait "$KQ_TRAINEE" Ready "$READY_TIMEOUT"
  stamp kueue_resumed
  split_readmit="$(kq_split "$KQ_TRAINEE" "$freed")"
  names_after="$(k -n "$TG_NS" get tg "$KQ_TRAINEE" -o jsonpath='{.status.workerNames}')"
  [[ "$names_after" != "$names_before" ]] || die "re-admitted under the same worker names: the group was not re-created"
  ready_line="$(e2e_ready_line "$KQ_TRAINEE")"
  log "re-admitted and Ready: $split_readmit; server: $ready_line"
  E2E_GROUP="$KQ_TRAINEE" e2e_client "$KQ_TRAINEE-b"
  A="$(e2e_steps "$KQ_TRAINEE-a")" B="$(e2e_steps "$KQ_TRAINEE-b")" READY="$ready_line" CKPT="$KQ_CKPT" \
    STEPS="$STEPS" ADMIT="$split_admit" READMIT="$split_readmit" HELD="$KQ_HELD_S" \
    URGENT="$KQ_URGENT_PLACED" SECONDS_="$(( $(date +%s) - KQ_T0 ))" python3 - <<'PY' | tee "$ARTIFACTS/kueue.json"
import json, os, sys
e = os.environ
a, b, ready = json.loads(e["A"]), json.loads(e["B"]), json.loads(e["READY"])
n, ckpt = int(e["STEPS"]), e["CKPT"]
def check(ok, what):
    if not ok:
        sys.exit(f"kueue check failed: {what}\n before: {a}\n after: {b}\n ready: {ready}")
check([s["optimizerStep"] for s in a] == list(range(1, n + 1)), f"the first client trains steps 1..{n}")
check(ready.get("resumedFrom") == ckpt and ready.get("resumedStep") == n,
      f"the re-admitted group resumed from {ckpt} at step {n}")
check([s["optimizerStep"] for s in b] == list(range(n + 1, 2 * n + 1)),
      f"the next client's steps continue: {n + 1}..{2 * n}")
print(json.dumps({"queued_while_held_s": int(e["HELD"]),
                  "admitted": json.loads(e["ADMIT"]), "readmitted": json.loads(e["READMIT"]),
                  "preemptor_placed_s": int(e["URGENT"]), "resumedFrom": ready["resumedFrom"],
                  "steps_after": [b[0]["optimizerStep"], b[-1]["optimizerStep"]],
                  "phase_seconds": int(e["SECONDS_"])}))
PY
  stamp kueue_done
  kq_cleanup
  log "phase kueue passed in $(( $(date +%s) - KQ_T0 ))s"
}

# A cluster that is deleted next needs no cleanup. A kept one must not keep Kueue: its webhooks
# refuse RayClusters while no Kueue pod answers, and its manager spends CPU.
kq_cleanup() {
  if [[ "${E2E_KEEP_CLUSTER:-0}" != 1 && -z "${E2E_STOP_AFTER:-}" ]]; then
    log "kueue: the cluster is deleted next: no cleanup"
    return 0
  fi
  k -n "$TG_NS" delete job "$KQ_TRAINEE-a" "$KQ_TRAINEE-b" --wait=false --ignore-not-found >/dev/null
  k -n "$TG_NS" delete tg "$KQ_TRAINEE" --timeout=600s >/dev/null
  wait_for 300 "$KQ_TRAINEE's and $KQ_HOLDER's RayClusters gone" \
    bash -c "! kubectl --context '$CTX' -n '$TG_NS' get raycluster '$KQ_TRAINEE' '$KQ_HOLDER' -o name 2>/dev/null | grep -q ."
  k -n "$TG_NS" delete deploy/redis svc/redis --wait=false --ignore-not-found >/dev/null
  k delete localqueue -n "$TG_NS" "$KQ_LQ" --ignore-not-found >/dev/null
  k delete clusterqueue "$KQ_CQ" --ignore-not-found >/dev/null
  k delete resourceflavor tg-e2e-flavor --ignore-not-found >/dev/null
  k delete workloadpriorityclass low high --ignore-not-found >/dev/null
  h uninstall kueue --namespace "$KQ_NS" --wait --timeout 5m >/dev/null
  k delete namespace "$KQ_NS" --ignore-not-found --wait=false >/dev/null
  log "kueue: groups, queues and Kueue removed from the kept cluster"
}
