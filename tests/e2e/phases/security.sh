# Sourced by tests/e2e/run.sh once the TrainerGroup is Ready and its client Job trained (the
# client mounts the group's token Secret and carries the client label): token authentication
# and the NetworkPolicy, seen from probe pods (tests/e2e/phases/ray_probe.py).
#   1. client label, no token:    the dashboard answers 401/403 to a read and to a job
#                                 submission; `ray start --address` (joining the GCS, which any
#                                 driver needs before it can attach to the workers) fails
#   2. client label, wrong token: 401/403
#   3. client label, the token:   200 (so 1 and 2 were refused for the token, not the network)
#   4. no label, the token:       no TCP to 8265 or 6379 when a NetworkPolicy enforcer runs
#                                 (tests/e2e/phases/netpol.sh); else reported as untested
# Figures go to $ARTIFACTS/security.json (docs/security.md).
log "security: the token Secret, the NetworkPolicy, probe pods"
SEC_T0=$(date +%s)
SECRET="$TG-ray-token"
k -n "$TG_NS" get secret "$SECRET" -o json | python3 -c '
import json, sys
s = json.load(sys.stdin); refs = s["metadata"].get("ownerReferences") or []
assert s["data"].get("auth_token"), "no auth_token key"
assert any(r["kind"] == "TrainerGroup" for r in refs), f"not owned by the TrainerGroup: {refs}"
' || die "Secret $SECRET missing, empty or not owned by the TrainerGroup"
k -n "$TG_NS" get networkpolicy "$TG-ray" -o jsonpath='{.spec.podSelector.matchLabels}' \
  | grep -q "ray.io/cluster" || die "NetworkPolicy $TG-ray missing"
k -n "$TG_NS" get raycluster "$TG" -o json | python3 -c '
import json, sys
rc = json.load(sys.stdin)["spec"]
tpls = [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]
for t in tpls:
    for c in t["spec"]["containers"]:
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "auth_token"
' || die "the RayCluster's containers lack RAY_AUTH_MODE=token / RAY_AUTH_TOKEN"

k -n "$TG_NS" create configmap tg-e2e-probe --from-file=ray_probe.py=tests/e2e/phases/ray_probe.py \
  --dry-run=client -o yaml | k apply -f - >/dev/null
probe_pod() {  # <name> <client label: 1|0> <token: none|wrong|secret> <join: 1|0>
  NAME="$1" LABEL="$2" TOKEN="$3" JOIN="$4" HOST="$TG-head-svc.$TG_NS.svc" SECRET="$SECRET" \
    TGNAME="$TG" PODNS="$TG_NS" python3 - <<'PY' | k apply -f - >/dev/null
import json, os
e = os.environ
env = [{"name": "PROBE_HOST", "value": e["HOST"]}, {"name": "PROBE_JOIN", "value": e["JOIN"]}]
ref = {"secretKeyRef": {"name": e["SECRET"], "key": "auth_token"}}
if e["TOKEN"] == "wrong":
    env += [{"name": "PROBE_BEARER", "value": "not-the-token"},
            {"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "value": "not-the-token"}]
elif e["TOKEN"] == "secret":
    env += [{"name": "PROBE_BEARER", "valueFrom": ref}, {"name": "RAY_AUTH_MODE", "value": "token"},
            {"name": "RAY_AUTH_TOKEN", "valueFrom": ref}]
labels = {"app.kubernetes.io/name": "tg-e2e-probe"}
if e["LABEL"] == "1":
    labels["trainergroup.io/client"] = e["TGNAME"]
print(json.dumps({"apiVersion": "v1", "kind": "Pod",
  "metadata": {"name": e["NAME"], "namespace": e["PODNS"], "labels": labels},
  "spec": {"restartPolicy": "Never", "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{
      "name": "probe", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
      "image": os.environ["RUNTIME_IMAGE"], "imagePullPolicy": "Never",
      "command": ["python", "/probe/ray_probe.py"], "env": env,
      "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}},
      "volumeMounts": [{"name": "probe", "mountPath": "/probe"}]}],
    "volumes": [{"name": "probe", "configMap": {"name": "tg-e2e-probe"}}]}}))
PY
}
k -n "$TG_NS" delete pod -l app.kubernetes.io/name=tg-e2e-probe --ignore-not-found --wait=true >/dev/null
probe_pod probe-notoken 1 none 1
probe_pod probe-wrongtoken 1 wrong 0
probe_pod probe-token 1 secret 0
probe_pod probe-unlabelled 0 secret 0
probe_done() {
  local p
  for p in probe-notoken probe-wrongtoken probe-token probe-unlabelled; do
    [[ "$(k -n "$TG_NS" get pod "$p" -o jsonpath='{.status.phase}')" =~ ^(Succeeded|Failed)$ ]] || return 1
  done
}
wait_for 300 "the 4 probe pods to finish" probe_done
for p in probe-notoken probe-wrongtoken probe-token probe-unlabelled; do
  k -n "$TG_NS" logs "$p" > "$ARTIFACTS/$p.log" 2>&1 || true
done
ENFORCED=0
k -n kube-system get ds tg-netpol >/dev/null 2>&1 && ENFORCED=1
ENFORCED="$ENFORCED" SECONDS_TAKEN=$(( $(date +%s) - SEC_T0 )) python3 - "$ARTIFACTS" <<'PY' \
  || die "security checks failed (probe logs in $ARTIFACTS/probe-*.log)"
import json, os, sys
art = sys.argv[1]
def probe(name):
    lines = [ln for ln in open(f"{art}/{name}.log") if ln.startswith("PROBE ")]
    if not lines:
        sys.exit(f"{name}: no PROBE line (see {art}/{name}.log)")
    return json.loads(lines[-1][6:])
no, wrong, ok, unl = (probe(n) for n in ("probe-notoken", "probe-wrongtoken", "probe-token",
                                         "probe-unlabelled"))
fail = []
refused = lambda s: s in (401, 403)
if not (no["tcp_dashboard"] and no["tcp_gcs"]):
    fail.append(f"a labelled client pod cannot reach the Ray ports at all: {no}")
if not (refused(no.get("get_jobs")) and refused(no.get("submit_job"))):
    fail.append(f"no token: the dashboard did not refuse: {no}")
if no.get("joined") is not False or not any(w in no.get("why", "").lower()
                                            for w in ("auth", "token", "unauthenticated")):
    fail.append(f"no token: ray start joined the GCS, or failed for another reason: {no}")
if not (refused(wrong.get("get_jobs")) and refused(wrong.get("submit_job"))):
    fail.append(f"wrong token: the dashboard did not refuse: {wrong}")
if ok.get("get_jobs") != 200:
    fail.append(f"the right token: the dashboard did not answer 200: {ok}")
enforced = os.environ["ENFORCED"] == "1"
if enforced and (unl["tcp_dashboard"] or unl["tcp_gcs"]):
    fail.append(f"an unlabelled pod reached the Ray ports despite the NetworkPolicy: {unl}")
n_refused = sum(refused(p.get(k)) for p in (no, wrong) for k in ("get_jobs", "submit_job"))
result = {"probes": {"no_token": no, "wrong_token": wrong, "token": ok, "unlabelled": unl},
          "requests_refused_without_token": n_refused + (no.get("joined") is False),
          "networkpolicy_enforced": enforced, "seconds": int(os.environ["SECONDS_TAKEN"])}
json.dump(result, open(f"{art}/security.json", "w"), indent=1)
print(f"{'probe pod':34} {'8265':5} {'6379':5} {'GET':5} {'POST':5} join")
for label, p in (("client label, no token", no), ("client label, wrong token", wrong),
                 ("client label, the token", ok), ("no label, the token", unl)):
    print(f"{label:34} {str(p['tcp_dashboard'])[0]:5} {str(p['tcp_gcs'])[0]:5} "
          f"{str(p.get('get_jobs', '-')):5} {str(p.get('submit_job', '-')):5} "
          f"{p.get('joined', '-')} {p.get('why', '')[:80]}")
print("NetworkPolicy enforced here: " + ("yes" if enforced else
      "NO (no enforcer in this cluster): the unlabelled probe is not a test"))
if fail:
    sys.exit("\n".join(fail))
PY
k -n "$TG_NS" delete pod -l app.kubernetes.io/name=tg-e2e-probe --wait=false >/dev/null
log "security checks passed in $(( $(date +%s) - SEC_T0 ))s"
