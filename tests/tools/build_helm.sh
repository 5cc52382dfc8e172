#!/usr/bin/env bash
# Build the real helm (its upstream source, from the Go module proxy) for the chart tests.
#
# The binary lands in ${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}/helm-<version>/helm, where
# tests/deploy/test_chart.py looks for it; a second run finds it there and builds nothing.
# Needs Go (1.24 or newer) and the module proxy; takes a few minutes on 2 cores.
set -euo pipefail

HELM_VERSION=v3.19.5
TOOLS="${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}"
DEST="$TOOLS/helm-$HELM_VERSION"

if [ -x "$DEST/helm" ]; then
  echo "helm $HELM_VERSION: already built at $DEST/helm"
  exit 0
fi
command -v go >/dev/null || { echo "build_helm.sh: needs go 1.24 or newer (Debian 12's golang-go is too old)" >&2; exit 1; }

mkdir -p "$DEST"
start=$(date +%s)
# The -X flags are the ones helm's own Makefile sets for a release: without them `helm
# version` says v3.19 and `helm template` assumes Kubernetes 1.20 (this release is built
# against the 1.34 client libraries). GOBIN puts the binary straight into the cache; nice
# keeps the build polite on a shared machine.
K8S_MINOR=34
LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  LDFLAGS="$LDFLAGS -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$K8S_MINOR"
done
GOBIN="$DEST" GOFLAGS="-trimpath -buildvcs=false" \
  nice -n 10 go install -ldflags "$LDFLAGS" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
echo "helm $HELM_VERSION: built in $(( $(date +%s) - start ))s at $DEST/helm"
