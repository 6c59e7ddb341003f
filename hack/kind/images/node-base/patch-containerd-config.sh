#!/bin/sh
# Edit kind's containerd config (version 2 format, which Debian's containerd 1.6 reads):
# every runc runtime gets BinaryName = the runc-dropcap wrapper. Runs at image build time.
set -eu
cfg="$1"
grep -q 'SystemdCgroup = true' "$cfg" || { echo "unexpected containerd config: no SystemdCgroup line" >&2; exit 1; }
sed -i 's|^\(\s*\)SystemdCgroup = true|\1SystemdCgroup = true\n\1BinaryName = "/usr/local/sbin/runc-dropcap"|' "$cfg"
# the fuse-overlayfs proxy plugin is not installed here
sed -i '/^\[proxy_plugins\]/,/^  address = /d' "$cfg"
grep -c 'BinaryName = "/usr/local/sbin/runc-dropcap"' "$cfg"
