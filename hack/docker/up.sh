#!/usr/bin/env bash
# Make sure a Docker engine is reachable: install Debian's docker.io if dockerd is absent,
# register the runc wrapper when this machine's capability bounding set lacks
# CAP_SYS_RESOURCE (privileged containers fail otherwise), start dockerd in the background
# if it is not running, and wait for it. Idempotent; prints the engine version last.
#
#   hack/docker/up.sh            (tools/test.sh and hack/kind/cluster.sh call it)
#
# Settings: TG_DOCKER_START_TIMEOUT=120 (seconds to wait for the engine),
#           TG_DOCKER_LOG=/var/log/trainergroup-dockerd.log
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log() { printf '%s docker-up: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
TIMEOUT="${TG_DOCKER_START_TIMEOUT:-120}"
DLOG="${TG_DOCKER_LOG:-/var/log/trainergroup-dockerd.log}"
# Debian's CLI matches Debian's engine and has BuildKit built in (a newer CLI elsewhere on
# PATH may want a buildx plugin that is not installed).
DOCKER=/usr/bin/docker

# Capability bit 24 is CAP_SYS_RESOURCE. The wrapper is (re)installed on every call, so an
# updated wrapper takes effect for the next container without restarting dockerd.
capbnd="$(awk '/^CapBnd:/ {print $2}' /proc/self/status)"
NEED_WRAPPER=0
if (( (16#$capbnd >> 24 & 1) == 0 )); then
  NEED_WRAPPER=1
  mkdir -p /usr/local/lib/trainergroup
  cmp -s "$HERE/runc-dropcap" /usr/local/lib/trainergroup/runc-dropcap \
    || install -m 0755 "$HERE/runc-dropcap" /usr/local/lib/trainergroup/runc-dropcap
fi

if [[ -x "$DOCKER" ]] && "$DOCKER" info >/dev/null 2>&1; then
  if (( NEED_WRAPPER )) && [[ "$("$DOCKER" info --format '{{.DefaultRuntime}}')" != tg-runc ]]; then
    die "dockerd runs without the runc wrapper this machine needs (privileged containers would fail with 'unable to apply caps'): stop dockerd and rerun $0"
  fi
  log "engine already running: $("$DOCKER" version --format '{{.Server.Version}}')"
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1 || [[ ! -x "$DOCKER" ]]; then
  [[ $EUID -eq 0 ]] || die "dockerd is not installed and this is not root: install docker.io (apt-get install -y docker.io) and retry"
  log "installing Debian's docker.io (apt-get)"
  timeout 600 apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq docker.io >/dev/null \
    || die "apt-get install docker.io failed"
fi

if (( NEED_WRAPPER )); then
  python3 - <<'PY'
import json, os
p = "/etc/docker/daemon.json"
cfg = json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else {}
cfg.setdefault("runtimes", {})["tg-runc"] = {"path": "/usr/local/lib/trainergroup/runc-dropcap"}
cfg["default-runtime"] = "tg-runc"
os.makedirs("/etc/docker", exist_ok=True)
json.dump(cfg, open(p, "w"), indent=2)
PY
  log "registered the runc wrapper (this machine lacks CAP_SYS_RESOURCE)"
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
  log "starting dockerd (log: $DLOG)"
  if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    systemctl restart docker
  else
    nohup dockerd >>"$DLOG" 2>&1 </dev/null &
  fi
fi
deadline=$(( $(date +%s) + TIMEOUT ))
until "$DOCKER" info >/dev/null 2>&1; do
  (( $(date +%s) < deadline )) || { tail -n 20 "$DLOG" >&2 || true; die "the engine did not answer within ${TIMEOUT}s; see $DLOG"; }
  sleep 1
done
log "engine ready: $("$DOCKER" version --format '{{.Server.Version}}')"
