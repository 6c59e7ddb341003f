#!/usr/bin/env bash
# Assemble the installable KubeRay chart in DEST: this folder's templates, plus the CRDs and
# the operator's ClusterRole rules from the ray-operator Go module at KUBERAY_VERSION
# (hack/versions.env), taken from the Go module cache. Prints DEST.
#   hack/kuberay-chart/prepare.sh DEST
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/../versions.env"
DEST="${1:?usage: prepare.sh DEST}"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"
MOD="$(cd "${TMPDIR:-/tmp}" && GOFLAGS=-mod=mod "$GO" mod download -json \
  "github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -f "$MOD/config/rbac/role.yaml" ]] || { echo "prepare: no config/rbac/role.yaml in '$MOD' (KUBERAY_VERSION=$KUBERAY_VERSION)" >&2; exit 1; }
rm -rf "$DEST"; mkdir -p "$DEST/crds" "$DEST/files"
cp -r "$HERE/Chart.yaml" "$HERE/values.yaml" "$HERE/templates" "$DEST/"
sed -i "s/^appVersion: .*/appVersion: \"$KUBERAY_VERSION\"/" "$DEST/Chart.yaml"
cp "$MOD"/config/crd/bases/*.yaml "$DEST/crds/"
cp "$MOD/config/rbac/role.yaml" "$DEST/files/role.yaml"
chmod -R u+w "$DEST"
echo "$DEST"
