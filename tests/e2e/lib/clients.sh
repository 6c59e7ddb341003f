# shellcheck shell=bash
# Helpers shared by the phases of tests/e2e/run.sh that train, save and resume (resume, kueue).
# Sourced; uses run.sh's k, log, die, wait_for, TG, TG_NS, GPU_NODE, CPU_NODE (fake mode),
# STEPS, ARTIFACTS, RUNTIME_IMAGE, MODE. Defines only e2e_* and E2E_* names.

e2e_client() {  # <job name> [client args...]: run the example client Job on group ${E2E_GROUP:-$TG}; its log in $ARTIFACTS
  local job="$1" t0 done_; shift
  k -n "$TG_NS" delete job "$job" --ignore-not-found --wait=true >/dev/null
  JOB="$job" GROUP="${E2E_GROUP:-$TG}" STEPS="$STEPS" EXTRA="$*" python3 - manifests/examples/client-job.yaml \
    > "$ARTIFACTS/$job.yaml" <<'PY'
import os, sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc["metadata"]["name"] = os.environ["JOB"]
group = os.environ["GROUP"]
pod = doc["spec"]["template"]
# the group's name, wherever the example names it: its status, its token, its NetworkPolicy
for labels in (doc["metadata"]["labels"], pod["metadata"]["labels"]):
    for key in ("trainergroup.io/name", "trainergroup.io/client"):
        if key in labels:
            labels[key] = group
c = pod["spec"]["containers"][0]
c["image"], c["imagePullPolicy"] = os.environ["RUNTIME_IMAGE"], "Never"
for e in c["env"]:
    if e["name"] == "TG_STEPS":
        e["value"] = os.environ["STEPS"]
    if e["name"] == "TG_NAME":
        e["value"] = group
    if e["name"] == "RAY_AUTH_TOKEN":
        e["valueFrom"]["secretKeyRef"]["name"] = f"{group}-ray-token"
c["args"] = [a.replace("--no-progress", "--no-progress " + os.environ["EXTRA"]) for a in c["args"]]
if os.environ["MODE"] == "fake":
    # 50m: a request, not a cap (no CPU limit). The client waits on the group; the CPU node has
    # 2 CPUs and the Ray head, the Tinker server, both operators, Kueue, the gateway, Redis and
    # DNS request most of them: at 250m this Job was Unschedulable for 30 min (CI, 13:25).
    c["resources"] = {"requests": {"cpu": "50m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
yaml.safe_dump(doc, sys.stdout, sort_keys=False)
PY
  k apply -f "$ARTIFACTS/$job.yaml" >/dev/null
  t0=$(date +%s)
  local unsched_since=0 why
  while :; do
    done_="$(k -n "$TG_NS" get job "$job" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {end}')"
    [[ "$done_" == *"Complete=True"* ]] && break
    [[ "$done_" == *"Failed=True"* ]] && { k -n "$TG_NS" logs "job/$job" --tail=50 >&2 || true; die "client Job $job failed"; }
    (( $(date +%s) - t0 < 1800 )) || die "client Job $job not done after 1800s"
    # a pod the scheduler cannot place will not start by waiting: say why after 180 s
    why="$(e2e_unschedulable "job-name=$job")"
    if [[ -z "$why" ]]; then
      unsched_since=0
    elif (( unsched_since == 0 )); then
      unsched_since=$(date +%s)
    elif (( $(date +%s) - unsched_since >= 180 )); then
      k describe nodes > "$ARTIFACTS/nodes-$job.txt" 2>&1 || true
      die "client Job $job: its pod is Unschedulable for 180s: $why (node requests: $ARTIFACTS/nodes-$job.txt)"
    fi
    sleep 3
  done
  k -n "$TG_NS" logs "job/$job" --tail=-1 > "$ARTIFACTS/$job.log"
  log "client Job $job done in $(( $(date +%s) - t0 ))s"
}

e2e_unschedulable() {  # <label selector>: the scheduler's message while a matching pod is Unschedulable, else nothing
  k -n "$TG_NS" get pod -l "$1" \
    -o jsonpath='{range .items[*].status.conditions[?(@.reason=="Unschedulable")]}{.message}{"\n"}{end}' \
    2>/dev/null | head -n 1
}

e2e_steps() {  # <job name>: its TG_STEP lines as a JSON list of {step, loss, optimizerStep, ...}
  python3 -c '
import json, sys
print(json.dumps([json.loads(l.split("TG_STEP ", 1)[1]) for l in open(sys.argv[1]) if "TG_STEP " in l]))' \
    "$ARTIFACTS/$1.log"
}

E2E_SHARED=/var/lib/tg-shared  # one host directory, mounted here in both workers (hack/kind/cluster.sh)

e2e_claim() {  # <claim> <pv> <dir>: a ReadWriteMany claim on $E2E_SHARED/<dir>, served to every worker node
  local claim="$1" pv="$2" dir="$E2E_SHARED/$3" nodes="$GPU_NODE${CPU_NODE:+,$CPU_NODE}"
  # A fresh directory as a new export is: root's, 0755. Only the pods' fsGroup (applied by the
  # kubelet to a local volume) makes it writable by the runtime's user (never world-writable).
  docker exec "$GPU_NODE" sh -c "mkdir -p '$dir' && chown 0:0 '$dir' && chmod 0755 '$dir'"
  if [[ -n "${CPU_NODE:-}" ]]; then
    docker exec "$CPU_NODE" test -d "$dir" \
      || die "$CPU_NODE does not see $dir made on $GPU_NODE: the workers do not share $E2E_SHARED (a cluster made before hack/kind/cluster.sh mounted it: run with E2E_REUSE_CLUSTER=0)"
  fi
  python3 tests/e2e/lib/shared_claim.py --claim "$claim" --pv "$pv" --namespace "$TG_NS" \
    --path "$dir" --nodes "$nodes" | k apply -f - >/dev/null
  e2e_bound() { [[ "$(k -n "$TG_NS" get pvc "$claim" -o jsonpath='{.status.phase}')" == Bound ]]; }
  wait_for 60 "claim $claim Bound" e2e_bound
  [[ "$(k -n "$TG_NS" get pvc "$claim" -o jsonpath='{.status.accessModes[0]}')" == ReadWriteMany ]] \
    || die "claim $claim is not ReadWriteMany once bound"
}

e2e_claim_owner() {  # <dir>: "uid:gid mode" of $E2E_SHARED/<dir> as the nodes see it
  docker exec "$GPU_NODE" stat -c '%u:%g %a' "$E2E_SHARED/$1"
}

e2e_ready_line() {  # [group]: the JSON of the newest server's TG_GROUP_READY line on the group's ($TG's) head pod
  local head line
  head="$(k -n "$TG_NS" get pod -l "ray.io/cluster=${1:-$TG},ray.io/node-type=head" -o name | head -n1)"
  # shellcheck disable=SC2016  # expanded in the head pod: the newest server job's ready line
  line="$(k -n "$TG_NS" exec "$head" -- bash -c 'cd /tmp/ray/session_latest/logs && grep -h TG_GROUP_READY $(ls -t job-driver-*.log) 2>/dev/null | head -n1')"
  echo "${line#*TG_GROUP_READY }"
}
