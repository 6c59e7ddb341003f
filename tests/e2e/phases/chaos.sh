# shellcheck shell=bash
# Phase "chaos" of tests/e2e/run.sh (E2E_CHAOS=1; off by default: it adds about 25 minutes):
# the seeded fault suite tests/e2e/chaos.py against the Ready example group (docs/chaos.md).
# Sourced after the other phases, before the deletion step; uses run.sh's log, die, stamp,
# CLUSTER, TG, TG_NS, ARTIFACTS. The table goes to the log, the rows to $ARTIFACTS/chaos.json.
log "phase chaos: seed ${E2E_CHAOS_SEED:-1}, faults ${E2E_CHAOS_FAULTS:-all}"
stamp chaos_start
python3 tests/e2e/chaos.py --seed "${E2E_CHAOS_SEED:-1}" --only "${E2E_CHAOS_FAULTS:-}" \
  --cluster "$CLUSTER" --namespace "$TG_NS" --name "$TG" --artifacts "$ARTIFACTS" \
  --json "$ARTIFACTS/chaos.json" | tee "$ARTIFACTS/chaos.txt" \
  || die "chaos: a fault was not survived (table above, $ARTIFACTS/chaos.json)"
stamp chaos_done
