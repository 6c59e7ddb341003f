# shellcheck shell=bash
# Phase "tinker" of tests/e2e/run.sh (sourced by it while the example TrainerGroup $TG is
# Ready; E2E_PHASES="resume tinker" or E2E_PHASES=tinker): the group's Tinker API server
# (spec.api.tinker, on by default) in real pods.
#
#   1. the operator's objects: Deployment, Service, NetworkPolicy $TG-tinker, Secret
#      $TG-tinker-keys with one tml- key, all owned by the TrainerGroup;
#   2. the Deployment becomes available and status.apiURL is http://$TG-tinker.$TG_NS.svc:8000;
#   3. manifests/examples/tinker-client-job.yaml (image and steps patched): the unmodified SDK
#      trains $STEPS steps through the Service with the key from the Secret (the loss falls) and
#      samples from the saved weights;
#   4. probe pods (tests/e2e/phases/tinker_probe.py): a labelled pod with a wrong key gets 401;
#      a pod without the client label gets no TCP to the server (when a NetworkPolicy enforcer
#      runs: tests/e2e/phases/netpol.sh); a key added to the Secret works, and stops working
#      once removed from it.
#
# Uses run.sh's k, log, die, wait_for, stamp, TG, TG_NS, STEPS, ARTIFACTS, RUNTIME_IMAGE, MODE;
# defines only tinker_* names. Figures go to $ARTIFACTS/tinker.json (docs/tinker.md).

TINKER_T0=$(date +%s)
TINKER_NAME="$TG-tinker"
TINKER_SECRET="$TG-tinker-keys"
TINKER_URL="http://$TINKER_NAME.$TG_NS.svc:8000"
log "phase tinker: the Tinker API server $TINKER_NAME"
stamp tinker_start

# ---- 1. the objects ---------------------------------------------------------------------------
for tinker_kind in deployment service networkpolicy serviceaccount role rolebinding; do
  k -n "$TG_NS" get "$tinker_kind" "$TINKER_NAME" -o json | python3 -c '
import json, sys
o = json.load(sys.stdin)
refs = o["metadata"].get("ownerReferences") or []
assert any(r["kind"] == "TrainerGroup" for r in refs), f"not owned by the TrainerGroup: {refs}"
' || die "$tinker_kind $TINKER_NAME missing or not owned by the TrainerGroup"
done
k -n "$TG_NS" get secret "$TINKER_SECRET" -o json | python3 -c '
import base64, json, sys
s = json.load(sys.stdin)
key = base64.b64decode(s["data"]["default"]).decode()
assert key.startswith("tml-") and len(key) > 20, "no tml- key under default"
assert any(r["kind"] == "TrainerGroup" for r in s["metadata"].get("ownerReferences") or [])
' || die "Secret $TINKER_SECRET missing, without a tml- key, or not owned"

# after phase resume the group has rayCluster.storage: the server's pod follows the spec and
# mounts the claim (rule update-tinker), since its state lives in training.checkpointDir
TINKER_CLAIM="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.spec.rayCluster.storage.claimName}')"
if [[ -n "$TINKER_CLAIM" ]]; then
  tinker_mounts_claim() {
    [[ "$(k -n "$TG_NS" get deployment "$TINKER_NAME" -o jsonpath='{.spec.template.spec.volumes[?(@.name=="checkpoints")].persistentVolumeClaim.claimName}')" == "$TINKER_CLAIM" ]]
  }
  wait_for 120 "Deployment $TINKER_NAME mounts claim $TINKER_CLAIM (the spec's storage)" tinker_mounts_claim
fi

# ---- 2. available, and the URL published ------------------------------------------------------
tinker_url_published() {
  [[ "$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.apiURL}')" == "$TINKER_URL" ]]
}
wait_for 900 "Deployment $TINKER_NAME available" \
  k -n "$TG_NS" wait --for=condition=Available "deployment/$TINKER_NAME" --timeout=5s
wait_for 120 "status.apiURL = $TINKER_URL" tinker_url_published
TINKER_READY_S=$(( $(date +%s) - TINKER_T0 ))
k -n "$TG_NS" get tg "$TG" -o wide
log "Tinker server available, status.apiURL published, ${TINKER_READY_S}s into the phase"

# ---- 3. the example SDK client Job ------------------------------------------------------------
TINKER_JOB="$TG-tinker-client"
k -n "$TG_NS" delete job "$TINKER_JOB" --ignore-not-found --wait=true >/dev/null
JOB="$TINKER_JOB" NS="$TG_NS" URL="$TINKER_URL" SECRET="$TINKER_SECRET" TGNAME="$TG" STEPS="$STEPS" \
  python3 - manifests/examples/tinker-client-job.yaml > "$ARTIFACTS/$TINKER_JOB.yaml" <<'EOF'
import os, sys, yaml
e = os.environ
doc = yaml.safe_load(open(sys.argv[1]))
doc["metadata"].update(name=e["JOB"], namespace=e["NS"])
tpl = doc["spec"]["template"]
tpl["metadata"]["labels"]["trainergroup.io/client"] = e["TGNAME"]
c = tpl["spec"]["containers"][0]
c["image"], c["imagePullPolicy"] = e["RUNTIME_IMAGE"], "Never"
for v in c["env"]:
    if v["name"] == "TINKER_BASE_URL":
        v["value"] = e["URL"]
    if v["name"] == "TINKER_API_KEY":
        v["valueFrom"]["secretKeyRef"]["name"] = e["SECRET"]
    if v["name"] == "TG_STEPS":
        v["value"] = e["STEPS"]
yaml.safe_dump(doc, sys.stdout, sort_keys=False)
EOF
k apply -f "$ARTIFACTS/$TINKER_JOB.yaml" >/dev/null
TINKER_JOB_T0=$(date +%s)
tinker_job_done() {
  local c
  c="$(k -n "$TG_NS" get job "$TINKER_JOB" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {end}')"
  [[ "$c" == *"Failed=True"* ]] && { k -n "$TG_NS" logs "job/$TINKER_JOB" --tail=60 >&2 || true
                                     die "Tinker client Job $TINKER_JOB failed"; }
  [[ "$c" == *"Complete=True"* ]]
}
wait_for 1200 "Tinker client Job $TINKER_JOB" tinker_job_done
TINKER_JOB_S=$(( $(date +%s) - TINKER_JOB_T0 ))
k -n "$TG_NS" logs "job/$TINKER_JOB" --tail=-1 > "$ARTIFACTS/$TINKER_JOB.log"
STEPS="$STEPS" python3 - "$ARTIFACTS/$TINKER_JOB.log" > "$ARTIFACTS/tinker-client.json" <<'EOF' \
  || die "Tinker client log checks failed ($ARTIFACTS/$TINKER_JOB.log)"
import json, math, os, sys
lines = open(sys.argv[1]).read().splitlines()
steps = [json.loads(ln.split("TG_TINKER_STEP ", 1)[1]) for ln in lines if "TG_TINKER_STEP " in ln]
samples = [json.loads(ln.split("TG_TINKER_SAMPLE ", 1)[1]) for ln in lines if "TG_TINKER_SAMPLE " in ln]
want = int(os.environ["STEPS"])
if len(steps) != want:
    sys.exit(f"{len(steps)} TG_TINKER_STEP lines, want {want}")
losses = [s["loss"] for s in steps]
if not all(isinstance(x, float) and math.isfinite(x) and x > 0 for x in losses):
    sys.exit(f"non-finite or non-positive loss: {losses}")
if not losses[-1] < losses[0]:
    sys.exit(f"the loss did not fall: {losses}")
if len(samples) != 1 or len(samples[0]["tokens"]) < 1:
    sys.exit(f"no sampled tokens: {samples}")
print(json.dumps({"steps": want, "first_loss": losses[0], "last_loss": losses[-1],
                  "sampled_tokens": len(samples[0]["tokens"])}))
EOF
log "Tinker client Job done in ${TINKER_JOB_S}s: $(cat "$ARTIFACTS/tinker-client.json")"

# ---- 4. probe pods: a wrong key, no label, a key added then removed ---------------------------
k -n "$TG_NS" create configmap tg-e2e-tinker-probe \
  --from-file=tinker_probe.py=tests/e2e/phases/tinker_probe.py \
  --dry-run=client -o yaml | k apply -f - >/dev/null
tinker_probe() {  # <name> <client label: 1|0> <mode: tcp|key> <key> <want> <seconds>
  NAME="$1" LABEL="$2" MODE_="$3" KEY="$4" WANT="$5" SECS="$6" HOST="$TINKER_NAME.$TG_NS.svc" \
    TGNAME="$TG" PODNS="$TG_NS" python3 - <<'PY' | k apply -f - >/dev/null
import json, os
e = os.environ
env = [{"name": n, "value": v} for n, v in (
    ("PROBE_HOST", e["HOST"]), ("PROBE_PORT", "8000"), ("PROBE_MODE", e["MODE_"]),
    ("PROBE_KEY", e["KEY"]), ("PROBE_WANT", e["WANT"]), ("PROBE_SECONDS", e["SECS"]),
    ("TINKER_TELEMETRY", "0"))]
labels = {"app.kubernetes.io/name": "tg-e2e-tinker-probe"}
if e["LABEL"] == "1":
    labels["trainergroup.io/client"] = e["TGNAME"]
print(json.dumps({"apiVersion": "v1", "kind": "Pod",
  "metadata": {"name": e["NAME"], "namespace": e["PODNS"], "labels": labels},
  "spec": {"restartPolicy": "Never", "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "seccompProfile": {"type": "RuntimeDefault"}},
    "automountServiceAccountToken": False, "containers": [{
      "name": "probe", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
      "image": e["RUNTIME_IMAGE"], "imagePullPolicy": "Never",
      "command": ["python", "/probe/tinker_probe.py"], "env": env,
      "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
      "volumeMounts": [{"name": "probe", "mountPath": "/probe"}]}],
    "volumes": [{"name": "probe", "configMap": {"name": "tg-e2e-tinker-probe"}}]}}))
PY
}
tinker_probe_result() {  # <name>: wait for the pod to finish, save its log, print its PROBE line
  local p="$1"
  tinker_finished() { [[ "$(k -n "$TG_NS" get pod "$p" -o jsonpath='{.status.phase}')" =~ ^(Succeeded|Failed)$ ]]; }
  wait_for 400 "probe pod $p" tinker_finished
  k -n "$TG_NS" logs "$p" > "$ARTIFACTS/$p.log" 2>&1 || true
  grep '^PROBE ' "$ARTIFACTS/$p.log" | tail -1 | cut -c7-
}
k -n "$TG_NS" delete pod -l app.kubernetes.io/name=tg-e2e-tinker-probe --ignore-not-found --wait=true >/dev/null
# a key a user adds works once the kubelet syncs the volume (hack/kind/cluster.sh sets its
# syncFrequency to 10s); removed, it stops working. The added key's probe runs beside the
# wrong-key and no-label probes (the no-label one takes its whole 30 s when the policy holds).
TINKER_USER_KEY="tml-e2e-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
k -n "$TG_NS" patch secret "$TINKER_SECRET" --type merge \
  -p "{\"stringData\":{\"e2e-user\":\"$TINKER_USER_KEY\"}}" >/dev/null
tinker_probe tinker-wrongkey 1 key "tml-not-a-key-of-this-group" 401 60
tinker_probe tinker-unlabelled 0 tcp - 0 30
tinker_probe tinker-added 1 key "$TINKER_USER_KEY" 200 240
TINKER_WRONG="$(tinker_probe_result tinker-wrongkey)"
TINKER_UNLABELLED="$(tinker_probe_result tinker-unlabelled)"
TINKER_ADDED="$(tinker_probe_result tinker-added)"
k -n "$TG_NS" patch secret "$TINKER_SECRET" --type json \
  -p '[{"op":"remove","path":"/data/e2e-user"}]' >/dev/null
tinker_probe tinker-removed 1 key "$TINKER_USER_KEY" 401 240
TINKER_REMOVED="$(tinker_probe_result tinker-removed)"

TINKER_ENFORCED=0
k -n kube-system get ds tg-netpol >/dev/null 2>&1 && TINKER_ENFORCED=1
WRONG="$TINKER_WRONG" UNL="$TINKER_UNLABELLED" ADDED="$TINKER_ADDED" REMOVED="$TINKER_REMOVED" \
  ENFORCED="$TINKER_ENFORCED" READY_S="$TINKER_READY_S" JOB_S="$TINKER_JOB_S" \
  SECS=$(( $(date +%s) - TINKER_T0 )) python3 - "$ARTIFACTS" <<'PY' \
  || die "Tinker server checks failed (probe logs in $ARTIFACTS/tinker-*.log)"
import json, os, sys
e = os.environ
def load(name):
    try:
        return json.loads(e[name])
    except ValueError:
        sys.exit(f"probe {name}: no PROBE line: {e[name]!r}")
wrong, unl, added, removed = load("WRONG"), load("UNL"), load("ADDED"), load("REMOVED")
client = json.load(open(f"{sys.argv[1]}/tinker-client.json"))
fail = []
if wrong.get("status") != 401:
    fail.append(f"a wrong key was not refused with 401: {wrong}")
enforced = e["ENFORCED"] == "1"
if enforced and unl.get("tcp"):
    fail.append(f"a pod without the client label reached the server despite the NetworkPolicy: {unl}")
if added.get("status") != 200:
    fail.append(f"a key added to the Secret was not accepted: {added}")
if removed.get("status") != 401:
    fail.append(f"a key removed from the Secret still works: {removed}")
result = {"client": client, "wrong_key": wrong, "unlabelled": unl, "key_added": added,
          "key_removed": removed, "networkpolicy_enforced": enforced,
          "available_after_s": int(e["READY_S"]), "client_job_s": int(e["JOB_S"]),
          "seconds": int(e["SECS"])}
json.dump(result, open(f"{sys.argv[1]}/tinker.json", "w"), indent=1)
print(json.dumps(result))
print("NetworkPolicy enforced here: " + ("yes" if enforced else
      "NO (no enforcer in this cluster): the unlabelled probe is not a test"))
if fail:
    sys.exit("\n".join(fail))
PY
k -n "$TG_NS" delete pod -l app.kubernetes.io/name=tg-e2e-tinker-probe --wait=false >/dev/null
stamp tinker_done
log "phase tinker passed in $(( $(date +%s) - TINKER_T0 ))s"
