#!/usr/bin/env bash
# Build the real kube2iam (commit 4c4a2b4, its newest) for the side-by-side record in
# tests/kube2iam.
#
# The binary lands in ${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}/kube2iam-4c4a2b4/kube2iam,
# where tests/kube2iam looks for it; a second run finds it there and builds nothing.
# Source: $KUBE2IAM_SRC, a read-only checkout of that commit (tests/run points it at
# ../shared/peers/kube2iam), built in a temporary copy so nothing is ever written into it.
# Without that tree: `go install` of the same commit from the public module proxy.
# Needs Go 1.24 or newer; about 3.5 minutes cold on 2 cores, seconds warm.
set -euo pipefail

KUBE2IAM_COMMIT=4c4a2b4b9e12
KUBE2IAM_VERSION=4c4a2b4
TOOLS="${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}"
DEST="$TOOLS/kube2iam-$KUBE2IAM_VERSION"

if [ -x "$DEST/kube2iam" ]; then
  echo "kube2iam $KUBE2IAM_VERSION: already built at $DEST/kube2iam"
  exit 0
fi
command -v go >/dev/null || { echo "build_kube2iam.sh: needs go 1.24 or newer" >&2; exit 1; }

mkdir -p "$DEST"
start=$(date +%s)
# Build into a temporary name and rename, so an interrupted build never looks finished.
partial="$DEST/kube2iam.partial.$$"
trap 'rm -f "$partial"' EXIT
if [ -n "${KUBE2IAM_SRC:-}" ] && [ -f "$KUBE2IAM_SRC/cmd/main.go" ]; then
  work=$(mktemp -d)
  cp -r "$KUBE2IAM_SRC/." "$work/src"
  chmod -R u+w "$work/src"
  (cd "$work/src" && GOFLAGS="-trimpath -buildvcs=false" nice -n 10 go build -o "$partial" ./cmd)
  rm -rf "$work"
  from="$KUBE2IAM_SRC"
else
  gobin=$(mktemp -d)
  GOBIN="$gobin" GOFLAGS="-trimpath -buildvcs=false" \
    nice -n 10 go install "github.com/jtblin/kube2iam/cmd@$KUBE2IAM_COMMIT"
  mv "$gobin/cmd" "$partial"
  rmdir "$gobin"
  from="the module proxy"
fi
mv "$partial" "$DEST/kube2iam"
echo "kube2iam $KUBE2IAM_VERSION: built from $from in $(( $(date +%s) - start ))s at $DEST/kube2iam"
