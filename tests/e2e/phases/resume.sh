# shellcheck shell=bash
# Phase "resume" of tests/e2e/run.sh (sourced by it, after the recovery step, while the example
# TrainerGroup $TG is Ready): a re-created group resumes from the last checkpoint, and the next
# loss continues from it.
#
#   1. a ReadWriteMany claim on the tree both worker nodes share (tests/e2e/lib/shared_claim.py:
#      this kernel has no NFS, so hack/kind/cluster.sh mounts one host directory in both
#      workers), its directory root's and 0755 as a fresh export is;
#   2. the TrainerGroup gets the claim (spec.rayCluster.storage) and a checkpointDir under its
#      mount: a new RayCluster, whose worker pod (GPU node) mounts the claim, and so does the
#      Tinker server's pod (CPU node): one claim on two nodes, which the operator admits only
#      because the claim is ReadWriteMany (tg_operator.claims); the group starts fresh;
#   3. a client trains $STEPS steps (from step 1) and saves a checkpoint into checkpointDir:
#      the first save works only because the pods' fsGroup made the volume theirs, and the
#      checkpoint written on the GPU node is read back on the CPU node;
#   4. the worker pod is deleted: the operator re-creates the group, whose init_model loads the
#      newest checkpoint (the server's TG_GROUP_READY line says resumedFrom / resumedStep);
#   5. a second client trains: its first step is $STEPS + 1 and its first loss is near the
#      first client's last one, far below a fresh model's (~ ln 256 = 5.55).
#
# Uses run.sh's k, log, die, wait_for, wait_phase, stamp, TG, TG_NS, GPU_NODE, CPU_NODE, STEPS, ARTIFACTS,
# RUNTIME_IMAGE, MODE and tests/e2e/lib/clients.sh's e2e_*; defines only resume_* names. Figures go to $ARTIFACTS/resume.json.

RESUME_T0=$(date +%s)
RESUME_ID="$RESUME_T0"
RESUME_CLAIM="tg-ckpt-$RESUME_ID"
RESUME_PV="tg-e2e-ckpt-$RESUME_ID"
RESUME_SUBDIR="ckpt-$RESUME_ID"
RESUME_HOST_DIR="$E2E_SHARED/$RESUME_SUBDIR"
RESUME_MOUNT=/checkpoints
RESUME_DIR="$RESUME_MOUNT/$TG"
RESUME_CKPT="$RESUME_DIR/step_$(printf '%08d' "$STEPS")"
log "phase resume: checkpoint claim $RESUME_CLAIM (ReadWriteMany, $RESUME_HOST_DIR on the worker nodes)"
stamp resume_start

e2e_claim "$RESUME_CLAIM" "$RESUME_PV" "$RESUME_SUBDIR"
RESUME_OWNER_BEFORE="$(e2e_claim_owner "$RESUME_SUBDIR")"

resume_field() { k -n "$TG_NS" get tg "$TG" -o jsonpath="{$1}"; }
resume_new_group_ready() {  # <old workerNames>: Ready, spec acted on, under new worker names
  [[ "$(resume_field .status.phase)" == Ready ]] \
    && [[ "$(resume_field .status.observedGeneration)" == "$(resume_field .metadata.generation)" ]] \
    && [[ "$(resume_field .status.workerNames)" != "$1" ]]
}

# ---- 2. the group gets the claim ----------------------------------------------------------------
NAMES_BEFORE="$(resume_field .status.workerNames)"
# The Tinker server keeps its state in checkpointDir too: its pod now mounts the claim (the
# operator replaces the server's pod template: rule update-tinker). It tolerates no GPU taint,
# so it stays on the CPU node while the worker pod runs on the GPU node.
k -n "$TG_NS" patch tg "$TG" --type merge -p "$(printf '{"spec": {"rayCluster": {"storage": {"claimName": "%s", "mountPath": "%s"}}, "training": {"checkpointDir": "%s"}}}' "$RESUME_CLAIM" "$RESUME_MOUNT" "$RESUME_DIR")"
wait_for "$READY_TIMEOUT" "TrainerGroup $TG Ready on a RayCluster with the claim" resume_new_group_ready "$NAMES_BEFORE"
stamp resume_storage_ready
RESUME_WPOD_CLAIM="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=worker" -o jsonpath='{.items[0].spec.volumes[?(@.name=="checkpoints")].persistentVolumeClaim.claimName}')"
[[ "$RESUME_WPOD_CLAIM" == "$RESUME_CLAIM" ]] || die "the worker pod does not mount claim $RESUME_CLAIM (got '$RESUME_WPOD_CLAIM')"
log "group Ready with $RESUME_CLAIM mounted at $RESUME_MOUNT in $(( $(date +%s) - RESUME_T0 ))s"
# one claim, two nodes: the worker pod's and the Tinker server's (fake mode has a CPU node)
resume_server_pods() {  # "<node> <claim>" per Running Tinker server pod
  k -n "$TG_NS" get pod -l "trainergroup.io/tinker=$TG" -o jsonpath='{range .items[?(@.status.phase=="Running")]}{.spec.nodeName} {.spec.volumes[?(@.name=="checkpoints")].persistentVolumeClaim.claimName}{"\n"}{end}'
}
resume_server_on_claim() {  # one Running server pod, and it mounts the claim
  local pods; pods="$(resume_server_pods)"
  [[ "$(wc -l <<<"$pods")" -eq 1 && "${pods##* }" == "$RESUME_CLAIM" ]]
}
if [[ -n "${CPU_NODE:-}" ]] && k -n "$TG_NS" get deployment "$TG-tinker" >/dev/null 2>&1; then
  wait_for 300 "one Tinker server pod Running, with claim $RESUME_CLAIM" resume_server_on_claim
  RESUME_SERVER_NODE="$(resume_server_pods)"; RESUME_SERVER_NODE="${RESUME_SERVER_NODE%% *}"
  RESUME_WORKER_NODE="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=worker" -o jsonpath='{.items[0].spec.nodeName}')"
  [[ "$RESUME_SERVER_NODE" != "$RESUME_WORKER_NODE" ]] \
    || die "the Tinker server and the worker pod share node $RESUME_WORKER_NODE: the claim is not tested across nodes"
  log "claim $RESUME_CLAIM mounted on two nodes: worker pod on $RESUME_WORKER_NODE, Tinker server on $RESUME_SERVER_NODE"
fi

# ---- 3. train and save a checkpoint -------------------------------------------------------------
e2e_client "$TG-resume-a" --save-checkpoint "$RESUME_CKPT"
grep -q "checkpoint saved to $RESUME_CKPT" "$ARTIFACTS/$TG-resume-a.log" \
  || die "client $TG-resume-a did not report the checkpoint $RESUME_CKPT"
# written by the worker pod on the GPU node, seen on the other node (the tree is shared)
RESUME_READER="${CPU_NODE:-$GPU_NODE}"
docker exec "$RESUME_READER" test -f "$RESUME_HOST_DIR/$TG/$(basename "$RESUME_CKPT")/meta.json" \
  || die "no complete checkpoint (meta.json) under $RESUME_HOST_DIR as $RESUME_READER sees it"
# the fresh directory was root's 0755: the kubelet gave it to the pods' fsGroup (gid 100,
# setgid), which is what let the first save succeed
RESUME_OWNER_AFTER="$(e2e_claim_owner "$RESUME_SUBDIR")"
[[ "${RESUME_OWNER_AFTER%% *}" == *:100 && "${RESUME_OWNER_AFTER##* }" == 2??? ]] \
  || die "the claim's directory is '$RESUME_OWNER_AFTER' (was '$RESUME_OWNER_BEFORE'): want group 100 with setgid (the pods' fsGroup)"
log "claim directory: $RESUME_OWNER_BEFORE before the pods, $RESUME_OWNER_AFTER after (fsGroup)"
stamp resume_saved

# ---- 4. the worker pod dies; the re-created group resumes ---------------------------------------
NAMES_BEFORE="$(resume_field .status.workerNames)"
RESUME_WPOD="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=worker" -o jsonpath='{.items[0].metadata.name}')"
log "deleting worker pod $RESUME_WPOD"
stamp resume_kill
k -n "$TG_NS" delete pod "$RESUME_WPOD" --wait=false
wait_for "$READY_TIMEOUT" "TrainerGroup $TG Ready again under new worker names" resume_new_group_ready "$NAMES_BEFORE"
stamp resume_recovered
RESUME_READY_LINE="$(e2e_ready_line)"
log "server: $RESUME_READY_LINE"

# ---- 5. the next loss continues from the checkpoint ---------------------------------------------
e2e_client "$TG-resume-b"
stamp resume_done
A="$(e2e_steps "$TG-resume-a")" B="$(e2e_steps "$TG-resume-b")" READY="$RESUME_READY_LINE" \
  CKPT="$RESUME_CKPT" STEPS="$STEPS" SECONDS_="$(( $(date +%s) - RESUME_T0 ))" python3 - <<'PY' | tee "$ARTIFACTS/resume.json"
import json, math, os, sys
a, b = json.loads(os.environ["A"]), json.loads(os.environ["B"])
ready = json.loads(os.environ["READY"])
n, ckpt = int(os.environ["STEPS"]), os.environ["CKPT"]
def check(ok, what):
    if not ok:
        sys.exit(f"resume check failed: {what}\n before: {a}\n after: {b}\n ready: {ready}")
# optimizerStep: the workers' step counter (the client's own "step" restarts at 1 per Job)
check([s["optimizerStep"] for s in a] == list(range(1, n + 1)),
      f"the first client trains optimizer steps 1..{n}")
check(ready.get("resumedFrom") == ckpt and ready.get("resumedStep") == n,
      f"the re-created group resumed from {ckpt} at step {n}")
check([s["optimizerStep"] for s in b] == list(range(n + 1, 2 * n + 1)),
      f"the next client's optimizer steps continue: {n + 1}..{2 * n}")
la, lb = [s["loss"] for s in a], [s["loss"] for s in b]
check(all(math.isfinite(x) for x in la + lb), "finite losses")
drop = la[0] - la[-1]
check(drop > 0, "the loss fell before the kill")
# Resumed, the first loss sits by the last one before the kill (the same batch, one more
# step); a fresh model would start again near la[0] (ln 256 = 5.55).
check(abs(lb[0] - la[-1]) < 0.5 * drop, f"first loss after {lb[0]:.4f} is near {la[-1]:.4f}")
check(lb[-1] < lb[0], "the loss keeps falling after the resume")
print(json.dumps({"steps_before": [a[0]["optimizerStep"], a[-1]["optimizerStep"]],
                  "steps_after": [b[0]["optimizerStep"], b[-1]["optimizerStep"]],
                  "loss_before": [round(la[0], 4), round(la[-1], 4)],
                  "loss_after": [round(lb[0], 4), round(lb[-1], 4)],
                  "resumedFrom": ready["resumedFrom"], "phase_seconds": int(os.environ["SECONDS_"])}))
PY
k -n "$TG_NS" delete job "$TG-resume-a" "$TG-resume-b" --wait=false --ignore-not-found >/dev/null
log "phase resume passed in $(( $(date +%s) - RESUME_T0 ))s"
