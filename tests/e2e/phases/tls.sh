# shellcheck shell=bash
# Phase "tls" of tests/e2e/run.sh (sourced by it while the example TrainerGroup $TG is Ready,
# after phases tinker and gateway: E2E_PHASES="resume tinker gateway tls"): the group's Tinker
# API server on HTTPS from a certificate Secret (spec.api.tls.secretName, issue 37), in real pods.
#
#   1. a CA and a server certificate naming the Service (tests/e2e/lib/tls_certs.sh, openssl,
#      made here), the pair as a kubernetes.io/tls Secret $TG-tinker-tls, the CA alone in a
#      ConfigMap $TG-tinker-ca (client pods get the CA, never the Secret);
#   2. the group gets spec.api.tls.secretName: the operator replaces the server's pod template
#      (rule update-tinker); the new pod serves HTTPS only and status.apiURL turns https://;
#   3. the example SDK client Job (manifests/examples/tinker-client-job.yaml) with
#      TINKER_BASE_URL=https://... and SSL_CERT_FILE=the CA from the ConfigMap trains
#      $E2E_TLS_STEPS steps (the loss falls) and samples;
#      with the gateway phase's gateway running (E2E_TLS_GATEWAY=0 skips it), the same Job again with
#      TINKER_BASE_URL=http://tinker-gateway...:8000 and no CA: the gateway verifies the group's
#      server against spec.api.tls.caBundle (the CA, set in step 2 beside secretName);
#   4. a probe pod (tests/e2e/phases/tls_probe.py): http:// to the port gets no HTTP answer,
#      https:// with only the public CAs does not verify, https:// with the CA answers 200.
#
# The group keeps TLS afterwards (the deletion step follows; phase tinker's checks assume
# http://, so run tls after it). Uses run.sh's k, log, die, wait_for, stamp, TG, TG_NS,
# ARTIFACTS, RUNTIME_IMAGE; defines only tls_* and TLS_* names. Figures: $ARTIFACTS/tls.json.

TLS_T0=$(date +%s)
TLS_SERVER="$TG-tinker"
TLS_HOST="$TLS_SERVER.$TG_NS.svc"
TLS_SECRET="$TG-tinker-tls"
TLS_CA_MAP="$TG-tinker-ca"
TLS_PORT="$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.spec.api.server.port}')"
TLS_PORT="${TLS_PORT:-8000}"
TLS_URL="https://$TLS_HOST:$TLS_PORT"
TLS_STEPS="${E2E_TLS_STEPS:-2}"
TLS_DIR="$ARTIFACTS/tls"
log "phase tls: the Tinker server $TLS_SERVER on HTTPS (Secret $TLS_SECRET)"
stamp tls_start
k -n "$TG_NS" get deployment "$TLS_SERVER" >/dev/null 2>&1 \
  || die "phase tls needs the group's Tinker server (spec.api.tinker, on by default): no Deployment $TLS_SERVER"

# ---- 1. the certificate, its Secret, the CA for clients ---------------------------------------
rm -rf "$TLS_DIR"
bash tests/e2e/lib/tls_certs.sh "$TLS_DIR" "$TLS_HOST" "$TLS_HOST.cluster.local"
k -n "$TG_NS" create secret tls "$TLS_SECRET" --cert="$TLS_DIR/tls.crt" --key="$TLS_DIR/tls.key" \
  --dry-run=client -o yaml | k apply -f - >/dev/null
k -n "$TG_NS" create configmap "$TLS_CA_MAP" --from-file=ca.crt="$TLS_DIR/ca.crt" \
  --dry-run=client -o yaml | k apply -f - >/dev/null
rm -f "$TLS_DIR/tls.key"  # the Secret holds it now

# ---- 2. the group serves HTTPS ------------------------------------------------------------------
# the CA's certificate as spec.api.tls.caBundle: the namespace's gateway verifies the server with it
TLS_PATCH="$(SECRET="$TLS_SECRET" python3 -c 'import json, os, sys
print(json.dumps({"spec": {"api": {"tls": {"secretName": os.environ["SECRET"],
                                           "caBundle": open(sys.argv[1]).read()}}}}))' "$TLS_DIR/ca.crt")"
k -n "$TG_NS" patch tg "$TG" --type merge -p "$TLS_PATCH" >/dev/null
tls_rolled_out() {  # the Deployment's pod template mounts the Secret, and its rollout is done
  [[ "$(k -n "$TG_NS" get deployment "$TLS_SERVER" -o jsonpath='{.spec.template.spec.volumes[?(@.name=="tls")].secret.secretName}')" == "$TLS_SECRET" ]] \
    && k -n "$TG_NS" rollout status "deployment/$TLS_SERVER" --timeout=5s
}
wait_for 600 "Deployment $TLS_SERVER rolled out with the Secret $TLS_SECRET" tls_rolled_out
tls_url_published() { [[ "$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.apiURL}')" == "$TLS_URL" ]]; }
wait_for 120 "status.apiURL = $TLS_URL" tls_url_published
TLS_READY_S=$(( $(date +%s) - TLS_T0 ))
log "Tinker server on HTTPS, status.apiURL $TLS_URL, ${TLS_READY_S}s into the phase"

# ---- 3. the SDK client over HTTPS, trusting the CA ----------------------------------------------
# tls_client JOB URL WITH_CA OUT: the example SDK client Job against URL (WITH_CA=1: trusting
# the CA through SSL_CERT_FILE), its STEPS steps and one sample checked into $ARTIFACTS/OUT.json
tls_client() {
local job="$1" url="$2" with_ca="$3" out="$4" t0
k -n "$TG_NS" delete job "$job" --ignore-not-found --wait=true >/dev/null
JOB="$job" NS="$TG_NS" URL="$url" SECRET="$TG-tinker-keys" CA_MAP="$TLS_CA_MAP" TGNAME="$TG" \
  WITH_CA="$with_ca" STEPS="$TLS_STEPS" python3 - manifests/examples/tinker-client-job.yaml > "$ARTIFACTS/$job.yaml" <<'EOF'
import os, sys, yaml
e = os.environ
doc = yaml.safe_load(open(sys.argv[1]))
doc["metadata"].update(name=e["JOB"], namespace=e["NS"])
tpl = doc["spec"]["template"]
tpl["metadata"]["labels"]["trainergroup.io/client"] = e["TGNAME"]
pod = tpl["spec"]
c = pod["containers"][0]
c["image"], c["imagePullPolicy"] = e["RUNTIME_IMAGE"], "Never"
values = {"TINKER_BASE_URL": e["URL"], "TG_STEPS": e["STEPS"]}
for v in c["env"]:
    if v["name"] in values:
        v["value"] = values[v["name"]]
    if v["name"] == "TINKER_API_KEY":
        v["valueFrom"]["secretKeyRef"]["name"] = e["SECRET"]
# the CA only, from the ConfigMap: httpx (the SDK's client) trusts SSL_CERT_FILE
if e["WITH_CA"] == "1":
    c["env"].append({"name": "SSL_CERT_FILE", "value": "/etc/tinker-ca/ca.crt"})
    c.setdefault("volumeMounts", []).append({"name": "tinker-ca", "mountPath": "/etc/tinker-ca", "readOnly": True})
    pod.setdefault("volumes", []).append({"name": "tinker-ca", "configMap": {"name": e["CA_MAP"]}})
yaml.safe_dump(doc, sys.stdout, sort_keys=False)
EOF
k apply -f "$ARTIFACTS/$job.yaml" >/dev/null
t0=$(date +%s)
TLS_JOB="$job"
wait_for 1200 "Tinker client Job $job ($url)" tls_job_done
TLS_JOB_S=$(( $(date +%s) - t0 ))
k -n "$TG_NS" logs "job/$job" --tail=-1 > "$ARTIFACTS/$job.log"
STEPS="$TLS_STEPS" python3 - "$ARTIFACTS/$job.log" > "$ARTIFACTS/$out.json" <<'EOF' \
  || die "Tinker client log checks failed ($ARTIFACTS/$job.log)"
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
if want > 1 and not losses[-1] < losses[0]:
    sys.exit(f"the loss did not fall: {losses}")
if len(samples) != 1 or len(samples[0]["tokens"]) < 1:
    sys.exit(f"no sampled tokens: {samples}")
print(json.dumps({"steps": want, "first_loss": losses[0], "last_loss": losses[-1],
                  "sampled_tokens": len(samples[0]["tokens"])}))
EOF
log "client Job $job ($url) done in ${TLS_JOB_S}s: $(cat "$ARTIFACTS/$out.json")"
k -n "$TG_NS" delete job "$job" --wait=false --ignore-not-found >/dev/null
}
tls_job_done() {
  local c
  c="$(k -n "$TG_NS" get job "$TLS_JOB" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {end}')"
  [[ "$c" == *"Failed=True"* ]] && { k -n "$TG_NS" logs "job/$TLS_JOB" --tail=60 >&2 || true
                                     die "Tinker client Job $TLS_JOB failed"; }
  [[ "$c" == *"Complete=True"* ]]
}
tls_client "$TG-tinker-tls-client" "$TLS_URL" 1 tls-client
TLS_CLIENT_S=$TLS_JOB_S
# Through the namespace's gateway too (phase gateway left it running; E2E_TLS_GATEWAY=0 skips
# it), plain HTTP to the gateway and no CA in the client: the gateway verifies the group against
# spec.api.tls.caBundle (issue 38). Its runs of 2026-12-06 09:15 and 12:11 failed for one
# reason, found in a kept cluster: the Job's create_model was refused because the direct client
# Job's session still held the group's one full-weight run (that client never finished its
# session). The example client finishes its session now (ServiceClient.close); the step passed
# at 12:39 (`E2E_PHASES="tinker gateway tls"`), and is a default since.
tls_gateway_lists_https() {
  k -n "$TG_NS" exec deploy/tinker-gateway -- python -c "import json, urllib.request as u
d = json.load(u.urlopen('http://127.0.0.1:8000/healthz', timeout=5))
raise SystemExit(0 if any(g['url'] == '$TLS_URL' for g in d['groups']) else 1)"
}
TLS_GW_S=0
if [[ "${E2E_TLS_GATEWAY:-1}" == 1 ]] && k -n "$TG_NS" get deployment tinker-gateway >/dev/null 2>&1; then
  wait_for 120 "the gateway lists $TG at $TLS_URL" tls_gateway_lists_https
  tls_client "$TG-tinker-tls-gw-client" "http://tinker-gateway.$TG_NS.svc:8000" 0 tls-gateway-client
  TLS_GW_S=$TLS_JOB_S
fi

# ---- 4. a probe pod: plain HTTP refused, the CA needed -----------------------------------------
k -n "$TG_NS" create configmap tg-e2e-tls-probe --from-file=tls_probe.py=tests/e2e/phases/tls_probe.py \
  --dry-run=client -o yaml | k apply -f - >/dev/null
k -n "$TG_NS" delete pod tls-probe --ignore-not-found --wait=true >/dev/null
HOST="$TLS_HOST" PORT="$TLS_PORT" CA_MAP="$TLS_CA_MAP" TGNAME="$TG" PODNS="$TG_NS" python3 - <<'PY' | k apply -f - >/dev/null
import json, os
e = os.environ
env = [{"name": n, "value": v} for n, v in (
    ("PROBE_HOST", e["HOST"]), ("PROBE_PORT", e["PORT"]), ("PROBE_SECONDS", "60"),
    ("PROBE_CA", "/etc/tinker-ca/ca.crt"))]
print(json.dumps({"apiVersion": "v1", "kind": "Pod",
  "metadata": {"name": "tls-probe", "namespace": e["PODNS"],
               "labels": {"app.kubernetes.io/name": "tg-e2e-tls-probe", "trainergroup.io/client": e["TGNAME"]}},
  "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{
      "name": "probe", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
      "image": e["RUNTIME_IMAGE"], "imagePullPolicy": "Never",
      "command": ["python", "/probe/tls_probe.py"], "env": env,
      "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
      "volumeMounts": [{"name": "probe", "mountPath": "/probe"},
                       {"name": "ca", "mountPath": "/etc/tinker-ca", "readOnly": True}]}],
    "volumes": [{"name": "probe", "configMap": {"name": "tg-e2e-tls-probe"}},
                {"name": "ca", "configMap": {"name": e["CA_MAP"]}}]}}))
PY
tls_probe_finished() { [[ "$(k -n "$TG_NS" get pod tls-probe -o jsonpath='{.status.phase}')" =~ ^(Succeeded|Failed)$ ]]; }
wait_for 300 "probe pod tls-probe" tls_probe_finished
k -n "$TG_NS" logs tls-probe > "$ARTIFACTS/tls-probe.log" 2>&1 || true
TLS_PROBE="$(grep '^PROBE ' "$ARTIFACTS/tls-probe.log" | tail -1 | cut -c7-)"
PROBE="$TLS_PROBE" READY_S="$TLS_READY_S" JOB_S="$TLS_CLIENT_S" GW_S="$TLS_GW_S" URL="$TLS_URL" \
  SECS=$(( $(date +%s) - TLS_T0 )) python3 - "$ARTIFACTS" <<'PY' || die "TLS checks failed ($ARTIFACTS/tls-probe.log)"
import json, os, sys
e = os.environ
try:
    probe = json.loads(e["PROBE"])
except ValueError:
    sys.exit(f"the probe printed no PROBE line: {e['PROBE']!r}")
fail = []
if isinstance(probe.get("plain"), int):
    fail.append(f"plain HTTP got an HTTP answer ({probe['plain']}): the port is not TLS-only")
if not str(probe.get("public_cas", "")).startswith("SSLCertVerificationError"):
    fail.append(f"https with only the public CAs did not fail verification: {probe.get('public_cas')}")
if probe.get("with_ca") != 200:
    fail.append(f"https with the CA did not answer 200: {probe.get('with_ca')}")
result = {"apiURL": e["URL"], "client": json.load(open(f"{sys.argv[1]}/tls-client.json")),
          "probe": probe, "https_after_s": int(e["READY_S"]), "client_job_s": int(e["JOB_S"]),
          "seconds": int(e["SECS"])}
if int(e["GW_S"]):
    result["gateway_client"] = json.load(open(f"{sys.argv[1]}/tls-gateway-client.json"))
    result["gateway_client_job_s"] = int(e["GW_S"])
json.dump(result, open(f"{sys.argv[1]}/tls.json", "w"), indent=1)
print(json.dumps(result))
if fail:
    sys.exit("\n".join(fail))
PY
k -n "$TG_NS" delete pod tls-probe --wait=false >/dev/null
stamp tls_done
log "phase tls passed in $(( $(date +%s) - TLS_T0 ))s"
