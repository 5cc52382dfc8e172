#!/usr/bin/env bash
# cert-manager's own CustomResourceDefinitions of Certificate and Issuer, for the server-side
# dry run of the chart's cert-manager objects (tests/k8s/test_chart_dry_run.py).
#
# They come from cert-manager's module on the Go module proxy (its zip holds deploy/crds/,
# the CRDs its release manifests are built from) and land in
# ${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}/cert-manager-crds-<version>/; a second run
# finds them there and fetches nothing. Needs Go and the module proxy; about 4 MB, seconds.
set -euo pipefail

CERT_MANAGER_VERSION=v1.21.2
TOOLS="${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}"
DEST="$TOOLS/cert-manager-crds-$CERT_MANAGER_VERSION"
CRDS=(cert-manager.io_certificates.yaml cert-manager.io_issuers.yaml)

if [ -f "$DEST/${CRDS[-1]}" ]; then
  echo "cert-manager CRDs $CERT_MANAGER_VERSION: already at $DEST"
  exit 0
fi
command -v go >/dev/null || { echo "fetch_cert_manager_crds.sh: needs go" >&2; exit 1; }

# `go mod download` outside any module: the module's source lands in the module cache
# (read-only); its directory is in the JSON answer.
work=$(mktemp -d)
trap 'rm -rf "$work" "$DEST.partial.$$"' EXIT
dir=$(cd "$work" && go mod download -json "github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION" \
      | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$dir/deploy/crds" ] || { echo "fetch_cert_manager_crds.sh: no deploy/crds in $dir" >&2; exit 1; }
mkdir -p "$DEST.partial.$$"
for crd in "${CRDS[@]}"; do
  cp "$dir/deploy/crds/$crd" "$DEST.partial.$$/"
done
chmod -R u+w "$DEST.partial.$$"
rm -rf "$DEST" && mv "$DEST.partial.$$" "$DEST"
echo "cert-manager CRDs $CERT_MANAGER_VERSION: at $DEST"
