#!/bin/sh
# Edit kind's containerd config (version 2 format, which Debian's containerd 1.6 reads):
# every runc runtime gets BinaryName = the runc-dropcap wrapper. Runs at image build time.
set -eu
cfg="$1"
grep -q 'SystemdCgroup = true' "$cfg" || { echo "unexpected containerd config: no SystemdCgroup line" >&2; exit 1; }
sed -i 's|^\(\s*\)SystemdCgroup = true|\1SystemdCgroup = true\n\1BinaryName = "/usr/local/sbin/runc-dropcap"|' "$cfg"
# Pods ask for oom_score_adj down to -998 (static pods, system-node-critical); lowering it
# needs CAP_SYS_RESOURCE, which this VM's bounding set (and so every node) lacks: runc then
# fails with "can't get final child's PID from pipe: EOF" (nsexec: failed to update
# /proc/self/oom_score_adj: Permission denied). restrict_oom_score_adj makes containerd's CRI
# clamp it to containerd's own value, as kind does for rootless nodes.
grep -q 'restrict_oom_score_adj = false' "$cfg" || { echo "unexpected containerd config: no restrict_oom_score_adj line" >&2; exit 1; }
sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' "$cfg"
# the fuse-overlayfs proxy plugin is not installed here
sed -i '/^\[proxy_plugins\]/,/^  address = /d' "$cfg"
grep -c 'BinaryName = "/usr/local/sbin/runc-dropcap"' "$cfg"
