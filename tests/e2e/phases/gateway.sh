# shellcheck shell=bash
# Phase "gateway" of tests/e2e/run.sh (a default phase, before tls: the gateway does not trust a
# group's own CA; after phase tinker, with
# the example TrainerGroup $TG Ready and serving): two TrainerGroups with different base model
# names behind the namespace's Tinker gateway (tg_operator.gateway, the chart's default
# gateway.mode=namespace), one SDK client reaching both by name.
#
#   1. a second group $TG-teacher (the same spec, spec.model.name org/teacher, small CPU
#      requests) becomes Ready and serves (status.apiURL);
#   2. the operator's Deployment tinker-gateway, owned by both groups, becomes Available
#      (restricted pod; its Role reads TrainerGroups, nothing else);
#   3. one key added to both groups' Secrets; a client pod (tests/e2e/phases/gateway_probe.py)
#      at http://tinker-gateway.$TG_NS.svc:8000 trains $TG (by its name, an alias the group
#      serves) and samples org/teacher through one ServiceClient; the loss falls;
#   4. $TG-teacher is deleted: the gateway stays (owned by $TG) and stops listing it.
#
# Uses run.sh's k, log, die, wait_for, stamp, TG, TG_NS, ARTIFACTS, RUNTIME_IMAGE; defines only
# gw_* / GW_* names. Figures go to $ARTIFACTS/gateway.json.

GW_T0=$(date +%s)
GW_TEACHER="$TG-teacher"
GW_URL="http://tinker-gateway.$TG_NS.svc:8000"
log "phase gateway: $TG and $GW_TEACHER behind $GW_URL"
stamp gateway_start

# ---- 1. the second group ---------------------------------------------------------------------
k -n "$TG_NS" get tg "$TG" -o json | TEACHER="$GW_TEACHER" python3 -c '
import json, os, sys
tg = json.load(sys.stdin)
spec = tg["spec"]
spec.setdefault("model", {})["name"] = "org/teacher"
spec.pop("rayClusterRef", None)
rc = spec.setdefault("rayCluster", {})
rc.pop("storage", None)  # its own, no shared claim
# small requests: the kind nodes have 2 CPUs each and the first group holds most of them
# (at 1 CPU for the head and 1500m for the worker the teacher was Unschedulable, 04:31). The
# head and the Tinker server go to the one CPU node, which holds 1,480m of requests before them
# (the first group head 1 CPU and server 250m, both operators, the gateway), 1,680m when both
# DNS pods land there too: at 200m + 250m the teacher server was then Unschedulable for 20 min
# (2026-12-06 08:15). The server keeps 250m: its CPU limit was its request then, and at 150m
# its raylet missed Ray fixed 30 s registration (08:43); at 250m the phase took 570 s (CI of
# f83d7e4). The server has no CPU limit since (operator/tg_operator/tinker.py). The probe pod below
# goes to the same node and asks for 10m: at 50m it was Pending there (09:10)
rc.setdefault("head", {})["cpu"] = "50m"  # no CPU limit: a request, not a cap
rc.setdefault("workers", {})["cpu"] = "200m"  # ray start --num-cpus 1
spec.setdefault("workers", {})["cpusPerProcess"] = 0.5  # two ranks in that one Ray CPU
print(json.dumps({"apiVersion": tg["apiVersion"], "kind": tg["kind"],
                  "metadata": {"name": os.environ["TEACHER"], "namespace": tg["metadata"]["namespace"]},
                  "spec": spec}))' > "$ARTIFACTS/$GW_TEACHER.json"
k apply -f "$ARTIFACTS/$GW_TEACHER.json" >/dev/null
gw_serving() { [[ -n "$(k -n "$TG_NS" get tg "$GW_TEACHER" -o jsonpath='{.status.apiURL}')" ]]; }
wait_for 1200 "TrainerGroup $GW_TEACHER serving (status.apiURL)" gw_serving

# ---- 2. the gateway's Deployment, owned by both groups ----------------------------------------
gw_owned_by_both() {
  k -n "$TG_NS" get deployment tinker-gateway -o json 2>/dev/null | TG="$TG" T="$GW_TEACHER" python3 -c '
import json, os, sys
d = json.load(sys.stdin)
owners = {r["name"] for r in d["metadata"].get("ownerReferences") or []}
sys.exit(0 if {os.environ["TG"], os.environ["T"]} <= owners else 1)'
}
wait_for 300 "Deployment tinker-gateway owned by $TG and $GW_TEACHER" gw_owned_by_both
wait_for 600 "Deployment tinker-gateway available" \
  k -n "$TG_NS" wait --for=condition=Available deployment/tinker-gateway --timeout=5s
k -n "$TG_NS" get deployment tinker-gateway -o json | python3 -c '
import json, sys
pod = json.load(sys.stdin)["spec"]["template"]["spec"]
c = pod["containers"][0]["securityContext"]
assert c["allowPrivilegeEscalation"] is False and c["capabilities"]["drop"] == ["ALL"]
assert pod["securityContext"]["runAsNonRoot"] is True' || die "tinker-gateway pod is not restricted"
k -n "$TG_NS" get role tinker-gateway -o jsonpath='{.rules}' | python3 -c '
import json, sys
assert json.load(sys.stdin) == [{"apiGroups": ["trainergroup.io"], "resources": ["trainergroups"],
                                 "verbs": ["get", "list", "watch"]}]' || die "tinker-gateway Role is not read-only"

# ---- 3. one key in both Secrets, one client for both groups ----------------------------------
GW_KEY="tml-e2e-gw-$(python3 -c 'import secrets; print(secrets.token_hex(16))')"
for gw_tg in "$TG" "$GW_TEACHER"; do
  k -n "$TG_NS" patch secret "$gw_tg-tinker-keys" --type merge \
    -p "{\"stringData\":{\"e2e-gw\":\"$GW_KEY\"}}" >/dev/null
done
k -n "$TG_NS" create configmap tg-e2e-gateway-probe \
  --from-file=gateway_probe.py=tests/e2e/phases/gateway_probe.py \
  --dry-run=client -o yaml | k apply -f - >/dev/null
k -n "$TG_NS" delete pod tg-e2e-gateway-probe --ignore-not-found --wait=true >/dev/null
GW_URL="$GW_URL" GW_KEY="$GW_KEY" STUDENT="$TG" TGNAME="$TG" PODNS="$TG_NS" python3 - <<'PY' | k apply -f - >/dev/null
import json, os
e = os.environ
env = [{"name": n, "value": v} for n, v in (
    ("GW_URL", e["GW_URL"]), ("GW_KEY", e["GW_KEY"]), ("GW_STUDENT", e["STUDENT"]),
    ("GW_TEACHER", "org/teacher"), ("GW_SECONDS", "400"), ("TINKER_TELEMETRY", "0"))]
print(json.dumps({"apiVersion": "v1", "kind": "Pod",
  "metadata": {"name": "tg-e2e-gateway-probe", "namespace": e["PODNS"],
               "labels": {"trainergroup.io/client": e["TGNAME"]}},
  "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100,
                        "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "probe", "image": e["RUNTIME_IMAGE"], "imagePullPolicy": "Never",
      "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
      "command": ["python", "/probe/gateway_probe.py"], "env": env,
      "resources": {"requests": {"cpu": "10m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
      "volumeMounts": [{"name": "probe", "mountPath": "/probe"}]}],
    "volumes": [{"name": "probe", "configMap": {"name": "tg-e2e-gateway-probe"}}]}}))
PY
gw_probe_done() { [[ "$(k -n "$TG_NS" get pod tg-e2e-gateway-probe -o jsonpath='{.status.phase}')" =~ ^(Succeeded|Failed)$ ]]; }
wait_for 600 "gateway client pod" gw_probe_done
k -n "$TG_NS" logs tg-e2e-gateway-probe > "$ARTIFACTS/gateway-probe.log" 2>&1 || true
GW_PROBE="$(grep '^PROBE ' "$ARTIFACTS/gateway-probe.log" | tail -1 | cut -c7-)"

# ---- 4. the teacher goes: the gateway stays (owned by $TG too) ---------------------------------
k -n "$TG_NS" delete tg "$GW_TEACHER" --wait=false >/dev/null
gw_teacher_gone() { ! k -n "$TG_NS" get tg "$GW_TEACHER" >/dev/null 2>&1; }
wait_for 600 "TrainerGroup $GW_TEACHER deleted" gw_teacher_gone
k -n "$TG_NS" get deployment tinker-gateway >/dev/null || die "the gateway went with $GW_TEACHER"
PROBE="$GW_PROBE" SECS=$(( $(date +%s) - GW_T0 )) STUDENT="$TG" python3 - > "$ARTIFACTS/gateway.json" <<'PY' \
  || die "gateway checks failed ($ARTIFACTS/gateway-probe.log)"
import json, os, sys
e = os.environ
try:
    p = json.loads(e["PROBE"])
except ValueError:
    sys.exit(f"no PROBE line: {e['PROBE']!r}")
if not p.get("ok"):
    sys.exit(f"the client failed: {p}")
if "org/teacher" not in p["models"] or len(p["models"]) < 2:
    sys.exit(f"capabilities do not list both groups: {p['models']}")
if not p["losses"][-1] < p["losses"][0]:
    sys.exit(f"the student's loss did not fall: {p['losses']}")
print(json.dumps({**p, "phase_s": int(e["SECS"])}))
PY
log "gateway phase done: $(cat "$ARTIFACTS/gateway.json")"
stamp gateway_end
