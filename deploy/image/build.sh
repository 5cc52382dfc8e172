#!/usr/bin/env bash
# Builds the kiamfast image without a docker engine or a registry, as root:
#
#   deploy/image/build.sh [NAME]     # NAME defaults to localhost/kiamfast/kiamfast:dev
#
# 1. The base, debian:bookworm-slim, made from Debian packages with mmdebstrap (minbase,
#    merged /usr, the slim image's dpkg excludes and apt settings) and committed with buildah
#    as docker.io/library/debian:bookworm-slim, the Dockerfile's default FROM.
# 2. `buildah bud --isolation chroot --layers --pull-never` of the Dockerfile, with the
#    machine's CA bundle as the build secret pip trusts (a user behind a TLS-intercepting
#    proxy does the same; a secret mount leaves nothing in a layer).
# 3. `buildah push` to an OCI archive, which `ctr images import` takes.
#
# Everything lives in $KIAMFAST_TOOLS/image-<hash of the base recipe>/: the base rootfs
# tarball, buildah's own storage (never the host's) with its layer cache. The last line of
# output is the archive's path.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
name=${1:-localhost/kiamfast/kiamfast:dev}
tools=${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}
ca_bundle=${KIAMFAST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
base_name=docker.io/library/debian:bookworm-slim
platform=${KIAMFAST_PLATFORM:-linux/amd64}
arch=${platform#linux/}
built="localhost/kiamfast/build:$arch"   # what buildah bud made, before the build facts

# What debian:bookworm-slim is: debuerreotype's minbase with its slimify excludes and its
# apt.conf.d files (without docker-clean a RUN's apt-get update leaves ~80 MB of
# /var/cache/apt/*.bin in a layer).
apt_caches="/var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin"
base_recipe=(
    --variant=minbase --architectures="$arch" --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    --skip=output/dev   # no device nodes in the image: the runtime makes /dev
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/groff/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/linda/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-include=/usr/share/locale/locale.alias'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='force-unsafe-io'
    --aptopt="DPkg::Post-Invoke { \"rm -f $apt_caches || true\"; }"
    --aptopt='Dir::Cache::pkgcache ""' --aptopt='Dir::Cache::srcpkgcache ""'
    --aptopt='Acquire::GzipIndexes "true"' --aptopt='Acquire::Languages "none"'
    --aptopt='Apt::AutoRemove::SuggestsImportant "false"'
    bookworm
)
mirrors=(
    "deb http://deb.debian.org/debian bookworm main"
    "deb http://deb.debian.org/debian bookworm-updates main"
    "deb http://deb.debian.org/debian-security bookworm-security main"
)
key=$(printf '%s\n' "${base_recipe[@]}" "${mirrors[@]}" | sha256sum | cut -c1-12)
work="$tools/image-$key"
mkdir -p "$work/storage/graph" "$work/storage/run"

# buildah's own storage under $work: the host's container storage is never touched.
cat >"$work/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$work/storage/graph"
runroot = "$work/storage/run"
CONF
export CONTAINERS_STORAGE_CONF="$work/storage.conf"

step() { printf 'deploy/image/build.sh: %s\n' "$*" >&2; }

base_tar="$work/base-$arch.tar"
if [[ ! -s $base_tar ]]; then
    step "base: mmdebstrap bookworm ($arch)"
    # (mmdebstrap picks its output format from the name's extension: .tar)
    mmdebstrap --quiet "${base_recipe[@]}" "$work/base-$arch.tmp.tar" "${mirrors[@]}"
    mv "$work/base-$arch.tmp.tar" "$base_tar"
fi
if ! buildah inspect --type image "$base_name-$arch" >/dev/null 2>&1; then
    step "base: buildah commit $base_name ($arch)"
    ctr=$(buildah from --arch "$arch" scratch)
    buildah add --quiet "$ctr" "$base_tar" /
    buildah config --arch "$arch" --os linux --cmd bash \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit --quiet --rm "$ctr" "$base_name-$arch" >/dev/null
fi
# The name the Dockerfile's FROM uses, for this build's architecture.
buildah tag "$base_name-$arch" "$base_name"

step "image: buildah bud $name ($platform)"
buildah bud --quiet --isolation chroot --layers --pull-never --platform "$platform" \
    --secret "id=ca-certificates,src=$ca_bundle" \
    --build-arg "SOURCE_DATE_EPOCH=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)" \
    -t "$built" -f "$repo/Dockerfile" "$repo" >/dev/null
# The build facts the Dockerfile takes as GIT_COMMIT and BUILD_DATE args are set on the built
# image here instead: buildah 1.28's layer cache ignores --build-arg values, so a cached ENV
# layer would keep the commit of the build that made it.
buildah rmi "$name" >/dev/null 2>&1 || true   # the previous build's, not the layer cache
ctr=$(buildah from --pull-never "$built")
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
buildah config --env "KIAMFAST_GIT_COMMIT=$commit" \
    --env "KIAMFAST_BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$ctr"
buildah commit --quiet --rm "$ctr" "$name" >/dev/null

# Renamed into place: a test session still importing the previous archive keeps reading it.
archive="$work/kiamfast-$arch.oci.tar"
buildah push --quiet "$name" "oci-archive:$archive.$$.tmp:$name"
mv "$archive.$$.tmp" "$archive"
echo "$archive"
