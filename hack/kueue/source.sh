#!/usr/bin/env bash
# Print the directory of Kueue's source (the Go module sigs.k8s.io/kueue at KUEUE_VERSION) in
# the Go module cache, downloading it from the Go module proxy the first time (24 MB; ~10 s).
# Its CRDs (config/components/crd/bases) and Helm chart (charts/kueue) come from here, so the
# tests use the same Kueue API as the Kueue they target.
#
#   hack/kueue/source.sh            the module directory (last line of stdout)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=version.env
source "$HERE/version.env"
GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "kueue/source.sh: no Go toolchain (set GO=/path/to/go)" >&2; exit 1
  fi
fi
export GOFLAGS="-mod=mod" GOTOOLCHAIN=local
dir="$(cd "${TMPDIR:-/tmp}" && "$GO" mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" \
  | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -f "$dir/config/components/crd/bases/kueue.x-k8s.io_workloads.yaml" ]] \
  || { echo "kueue/source.sh: no Kueue CRDs under '$dir'; check KUEUE_VERSION and Go proxy access" >&2; exit 1; }
echo "$dir"
