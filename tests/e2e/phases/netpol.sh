# Sourced by tests/e2e/run.sh (fake mode) after the images are loaded: tg-cni enforces no
# NetworkPolicy, so deploy an enforcer (kube-router's policy controller; hack/kind/netpol.sh
# says why not kube-network-policies) before anything that a policy will select starts.
log "NetworkPolicy enforcer (hack/kind/netpol.sh)"
NETPOL_T0=$(date +%s)
TG_KIND_CLUSTER="$CLUSTER" bash hack/kind/netpol.sh up || die "the NetworkPolicy enforcer did not start"
log "NetworkPolicy enforcer ready in $(( $(date +%s) - NETPOL_T0 ))s"
stamp netpol
