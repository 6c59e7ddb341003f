# Sourced by tests/e2e/run.sh after the first group is deleted: GCS fault tolerance.
# A Redis from Debian's packages (hack/kind/redis.sh); the same TrainerGroup again with
# spec.rayCluster.gcsFaultTolerance; the head pod is deleted; the detached workers must live
# on (same worker pod, same workerNames, same groupGeneration: the group is not re-created)
# and the next client Job trains. Recovery times go to $ARTIFACTS/gcs-ft.json.
# With the Kueue phase (KQ_ON=1, tests/e2e/phases/kueue.sh sourced first), this group is queued
# at low priority and holds the queue's whole GPU quota: the Kueue phase's group waits behind
# it (kq_trainee_apply, kq_trainee_waited) and is admitted once it is deleted (kq_after_holder).
log "GCS fault tolerance: Redis, a group with gcsFaultTolerance, the head pod deleted"
FT_T0=$(date +%s)
TG_KIND_CLUSTER="$CLUSTER" bash hack/kind/redis.sh up "$TG_NS" || die "Redis did not start"
k patch --local -f "$ARTIFACTS/trainergroup.yaml" --type merge -o yaml \
  -p "{\"spec\":{\"rayCluster\":{\"gcsFaultTolerance\":{\"redisAddress\":\"redis.$TG_NS.svc:6379\"}}}}" \
  > "$ARTIFACTS/trainergroup-ft.yaml"
if (( ${KQ_ON:-0} )); then
  k patch --local -f "$ARTIFACTS/trainergroup-ft.yaml" --type merge -o yaml -p "$(kq_queue_patch low)" \
    > "$ARTIFACTS/trainergroup-ft-queued.yaml"
  mv "$ARTIFACTS/trainergroup-ft-queued.yaml" "$ARTIFACTS/trainergroup-ft.yaml"
fi
# the first group's token Secret must be garbage-collected first (docs/security.md: a
# re-created group of the same name would otherwise find its predecessor's Secret)
old_secret_gone() { ! k -n "$TG_NS" get secret "$TG-ray-token" >/dev/null 2>&1; }
wait_for 120 "the deleted group's Secret garbage-collected" old_secret_gone
k apply -f "$ARTIFACTS/trainergroup-ft.yaml" >/dev/null
wait_phase Ready "$READY_TIMEOUT"
FT_READY=$(date +%s)
(( ${KQ_ON:-0} )) && kq_trainee_apply
k -n "$TG_NS" get raycluster "$TG" -o jsonpath='{.spec.gcsFaultToleranceOptions.redisAddress}' \
  | grep -q "redis.$TG_NS.svc:6379" || die "the RayCluster has no gcsFaultToleranceOptions"
ft_state() {  # workerNames|groupGeneration|worker pod uid
  printf '%s|%s|%s' "$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.workerNames}')" \
    "$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.groupGeneration}')" \
    "$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=worker" -o jsonpath='{.items[0].metadata.uid}')"
}
BEFORE="$(ft_state)"
HEAD_UID="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=head" -o jsonpath='{.items[0].metadata.uid}')"
HEAD_POD="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=head" -o jsonpath='{.items[0].metadata.name}')"
log "deleting head pod $HEAD_POD (state before: $BEFORE)"
KILL_T=$(date +%s)
k -n "$TG_NS" delete pod "$HEAD_POD" --wait=false >/dev/null
new_head_ready() {
  local uid ready
  uid="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=head" -o jsonpath='{.items[0].metadata.uid}')"
  ready="$(k -n "$TG_NS" get pod -l "ray.io/cluster=$TG,ray.io/node-type=head" -o jsonpath='{.items[0].status.conditions[?(@.type=="Ready")].status}')"
  [[ -n "$uid" && "$uid" != "$HEAD_UID" && "$ready" == True ]]
}
wait_for 600 "a new head pod Ready" new_head_ready
HEAD_BACK=$(date +%s)
group_ready_again() {
  [[ "$(tg_phase)" == Ready ]] || return 1
  [[ "$(k -n "$TG_NS" get tg "$TG" -o jsonpath='{.status.workers[*].state}')" != *DEAD* ]]
}
wait_for 600 "the TrainerGroup Ready after the head came back" group_ready_again
GROUP_BACK=$(date +%s)
AFTER="$(ft_state)"
[[ "$AFTER" == "$BEFORE" ]] || die "the group was re-created or its worker pod replaced: before $BEFORE, after $AFTER"
log "head back in $((HEAD_BACK - KILL_T))s, group Ready in $((GROUP_BACK - KILL_T))s, same workers: $AFTER"
FT_CLIENT_T0=$(date +%s)
run_client "$TG-client-ft"
FT_CLIENT_S=$(( $(date +%s) - FT_CLIENT_T0 ))
[[ "$(ft_state)" == "$BEFORE" ]] || die "training after the head restart re-created the group"
printf '{"ready_s": %d, "head_back_s": %d, "group_ready_s": %d, "client_s": %d, "same": "%s"}\n' \
  $((FT_READY - FT_T0)) $((HEAD_BACK - KILL_T)) $((GROUP_BACK - KILL_T)) "$FT_CLIENT_S" "${AFTER//\"/}" \
  > "$ARTIFACTS/gcs-ft.json"
(( ${KQ_ON:-0} )) && kq_trainee_waited
k -n "$TG_NS" delete job "$TG-client-ft" --wait=false --ignore-not-found >/dev/null
FT_DELETE_T=$(date +%s)
k -n "$TG_NS" delete tg "$TG" --timeout=600s >/dev/null
log "GCS fault tolerance checks passed in $(( $(date +%s) - FT_T0 ))s"
if (( ${KQ_ON:-0} )); then
  # Redis stays until the group's RayCluster is gone: KubeRay's cleanup Job for its GCS
  # state needs it (without Redis the cleanup holds the RayCluster, and with it the queue's
  # quota, for its whole 300 s deadline). kq_cleanup removes it from a kept cluster.
  kq_after_holder "$FT_DELETE_T"
else
  k -n "$TG_NS" delete deploy/redis svc/redis --wait=false >/dev/null
fi
