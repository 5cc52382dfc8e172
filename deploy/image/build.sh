#!/usr/bin/env bash
# Builds the kiamfast image without a docker engine or a registry, as root:
#
#   deploy/image/build.sh [NAME]     # NAME defaults to localhost/kiamfast/kiamfast:dev
#   KIAMFAST_PLATFORM=linux/arm64 deploy/image/build.sh NAME   # default linux/amd64
#
# 1. The base, debian:bookworm-slim for the platform's architecture, made from Debian packages
#    with mmdebstrap (minbase, merged /usr, the slim image's dpkg excludes and apt settings;
#    a foreign architecture's maintainer scripts run under qemu-user-static via binfmt_misc)
#    and committed with buildah as localhost/kiamfast/base/debian:bookworm-slim-<arch>, a name
#    per architecture passed as the Dockerfile's BASE_IMAGE: two architectures never share it.
# 2. `buildah bud --isolation chroot --layers --pull-never` of the Dockerfile, with the
#    machine's CA bundle as the build secret pip trusts (a user behind a TLS-intercepting
#    proxy does the same; a secret mount leaves nothing in a layer). A foreign architecture's
#    RUN steps run emulated.
# 3. deploy/image/check_arch.sh: the compiled extensions are of the platform's architecture
#    (a base of the wrong one builds with only a warning), then `buildah push` to an OCI
#    archive, which `ctr images import` takes.
#
# Everything lives in $KIAMFAST_TOOLS/image-<hash of the base recipe>/, shared by both
# architectures: the base rootfs tarballs, buildah's own storage (never the host's) with its
# layer cache. Builds of one architecture take turns (a lock per architecture). The last line
# of output is the archive's path; the image NAME stays in that storage (deploy/release.sh
# makes its multi-arch list from there).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
name=${1:-localhost/kiamfast/kiamfast:dev}
tools=${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}
ca_bundle=${KIAMFAST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
platform=${KIAMFAST_PLATFORM:-linux/amd64}
arch=${platform#linux/}
case $arch in
    amd64) qemu=qemu-x86_64 ;;
    arm64) qemu=qemu-aarch64 ;;
    *) echo "deploy/image/build.sh: KIAMFAST_PLATFORM=$platform: linux/amd64 or linux/arm64" >&2
       exit 2 ;;
esac
base_name=localhost/kiamfast/base/debian:bookworm-slim-$arch
# Another architecture's programs (dpkg's maintainer scripts, the RUN steps) run under qemu,
# registered with binfmt_misc with the F flag so that it works inside the build's chroot.
if [[ $arch != "$(dpkg --print-architecture)" ]] &&
   ! grep -qx 'flags: .*F.*' "/proc/sys/fs/binfmt_misc/$qemu" 2>/dev/null; then
    echo "deploy/image/build.sh: $platform on $(dpkg --print-architecture) needs $qemu" \
         "registered with binfmt_misc (apt-get install qemu-user-static binfmt-support)" >&2
    exit 2
fi
built="localhost/kiamfast/build:$arch"   # what buildah bud made, before the build facts

# What debian:bookworm-slim is: debuerreotype's minbase with its slimify excludes and its
# apt.conf.d files (without docker-clean a RUN's apt-get update leaves ~80 MB of
# /var/cache/apt/*.bin in a layer).
apt_caches="/var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin"
base_recipe=(
    --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
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
# (the architecture is not part of the key: both share the storage and its layer cache)
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

# One build of an architecture at a time (sessions share the cache): the base and the
# intermediate name below are per architecture.
exec 9>"$work/build-$arch.lock"
flock 9

step() { printf 'deploy/image/build.sh: %s\n' "$*" >&2; }

base_tar="$work/base-$arch.tar"
if [[ ! -s $base_tar ]]; then
    step "base: mmdebstrap bookworm ($arch)"
    # (mmdebstrap picks its output format from the name's extension: .tar)
    mmdebstrap --quiet --architectures="$arch" "${base_recipe[@]}" "$work/base-$arch.tmp.tar" \
        "${mirrors[@]}"
    mv "$work/base-$arch.tmp.tar" "$base_tar"
fi
if ! buildah inspect --type image "$base_name" >/dev/null 2>&1; then
    step "base: buildah commit $base_name ($arch)"
    ctr=$(buildah from --arch "$arch" scratch)
    buildah add --quiet "$ctr" "$base_tar" /
    buildah config --arch "$arch" --os linux --cmd bash \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit --quiet --rm "$ctr" "$base_name" >/dev/null
fi

step "image: buildah bud $name ($platform)"
buildah bud --quiet --isolation chroot --layers --pull-never --platform "$platform" \
    --secret "id=ca-certificates,src=$ca_bundle" --build-arg "BASE_IMAGE=$base_name" \
    --build-arg "SOURCE_DATE_EPOCH=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)" \
    -t "$built" -f "$repo/Dockerfile" "$repo" >/dev/null
# The build facts the Dockerfile takes as GIT_COMMIT and BUILD_DATE args are set on the built
# image here instead: buildah 1.28's layer cache ignores --build-arg values, so a cached ENV
# layer would keep the commit of the build that made it.
buildah rmi "$name" >/dev/null 2>&1 || true   # the previous build's, not the layer cache
ctr=$(buildah from --pull-never --arch "$arch" "$built")
commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
buildah config --env "KIAMFAST_GIT_COMMIT=$commit" \
    --env "KIAMFAST_BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$ctr"
buildah commit --quiet --rm "$ctr" "$name" >/dev/null
if ! "$repo/deploy/image/check_arch.sh" "$name" "$arch"; then
    buildah rmi "$name" >/dev/null
    exit 1
fi

# Renamed into place: a test session still importing the previous archive keeps reading it.
archive="$work/kiamfast-$arch.oci.tar"
buildah push --quiet "$name" "oci-archive:$archive.$$.tmp:$name"
mv "$archive.$$.tmp" "$archive"
echo "$archive"
