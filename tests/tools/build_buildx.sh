#!/usr/bin/env bash
# Build docker's buildx CLI plugin (its upstream source, from the Go module proxy) for
# tests/release/test_release_args.py, which lints deploy/release.sh's `docker buildx build`
# against it. Only the plugin: the tests never start or ask a docker engine.
#
# The binary lands in ${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}/buildx-<version>/docker-buildx;
# a second run finds it there and builds nothing. Needs Go and the module proxy; takes a few
# minutes on 2 cores.
set -euo pipefail

BUILDX_VERSION=v0.38.2
TOOLS="${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}"
DEST="$TOOLS/buildx-$BUILDX_VERSION"

if [ -x "$DEST/docker-buildx" ]; then
  echo "buildx $BUILDX_VERSION: already built at $DEST/docker-buildx"
  exit 0
fi
command -v go >/dev/null || { echo "build_buildx.sh: needs go" >&2; exit 1; }

mkdir -p "$DEST"
start=$(date +%s)
GOBIN="$DEST/bin" GOFLAGS="-trimpath -buildvcs=false" \
  nice -n 10 go install -ldflags "-s -w -X github.com/docker/buildx/version.Version=$BUILDX_VERSION" \
  "github.com/docker/buildx/cmd/buildx@$BUILDX_VERSION"
mv "$DEST/bin/buildx" "$DEST/docker-buildx"
rmdir "$DEST/bin"
echo "buildx $BUILDX_VERSION: built in $(( $(date +%s) - start ))s at $DEST/docker-buildx"
