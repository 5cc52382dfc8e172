#!/usr/bin/env bash
# Cuts a release: the image for linux/amd64 and linux/arm64 as one multi-arch index, and the
# Helm chart as an OCI artifact, both pushed to a registry you name. As root, on Debian:
#
#   deploy/release.sh [--plain-http] VERSION REPOSITORY
#   deploy/release.sh 0.1.0 ghcr.io/kiamfast    # ghcr.io/kiamfast/kiamfast:0.1.0 and
#                                               # oci://ghcr.io/kiamfast/charts/kiamfast 0.1.0
#
# VERSION is kiamfast's own (kiamfast/__init__.py), optionally with a pre-release suffix
# (0.1.0-rc.1): the image tag, the chart's version and its appVersion. REPOSITORY is a
# registry host and path; log in first (`buildah login HOST`, `helm registry login HOST`).
# --plain-http talks HTTP to the registry (a registry on loopback, as the tests run one).
#
# 1. deploy/image/build.sh for each platform, in parallel (a base per architecture, so they
#    never share one); linux/arm64 runs emulated on another machine (qemu-user-static
#    registered with binfmt_misc). Each build checks its extensions are of its architecture.
# 2. `buildah manifest create/add` of both into one index, `buildah manifest push --all` as
#    REPOSITORY/kiamfast:VERSION; the index digest is printed.
# 3. The chart, with REPOSITORY/kiamfast as its image wherever it names ghcr.io/kiamfast/kiamfast
#    (values and the kube2iam-image swap), `helm package` with version = appVersion = VERSION,
#    `helm push` to oci://REPOSITORY/charts.
#
# HELM names the helm binary (default: helm on PATH). The last line of output is the
# image's reference by digest.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
platforms=(linux/amd64 linux/arm64)
usage="usage: deploy/release.sh [--plain-http] VERSION REPOSITORY"
fail() { echo "deploy/release.sh: $*" >&2; exit 2; }   # a bad argument
die() { echo "deploy/release.sh: $*" >&2; exit 1; }    # a step that failed

plain_http=false
args=()
for arg in "$@"; do
    case $arg in
        --plain-http) plain_http=true ;;
        -*) fail "unknown flag: $arg ($usage)" ;;
        *) args+=("$arg") ;;
    esac
done
(( ${#args[@]} == 2 )) || fail "$usage"
version=${args[0]} repository=${args[1]%/}
kiamfast_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/kiamfast/__init__.py")
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
    fail "VERSION $version: not a version like 0.1.0 or 0.1.0-rc.1"
[[ ${version%%-*} == "$kiamfast_version" ]] ||
    fail "VERSION $version: kiamfast is $kiamfast_version (kiamfast/__init__.py): bump it first"
[[ $repository =~ ^[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$ ]] ||
    fail "REPOSITORY $repository: not a registry host and path like ghcr.io/kiamfast"
helm=${HELM:-helm}
command -v "$helm" >/dev/null || fail "needs helm (HELM=$helm)"
command -v buildah >/dev/null || fail "needs buildah (apt-get install buildah mmdebstrap)"

image="$repository/kiamfast:$version"
chart_repo="oci://$repository/charts"
tls=(); helm_tls=()
if $plain_http; then tls=(--tls-verify=false); helm_tls=(--plain-http); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { printf 'deploy/release.sh: %s\n' "$*" >&2; }
if [[ -n $(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    step "warning: uncommitted changes are built in; the image names commit" \
         "$(git -C "$repo" rev-parse --short HEAD)"
fi

# ---- 1. the image for each platform, in the build script's own storage ----
pids=()
for platform in "${platforms[@]}"; do
    arch=${platform#linux/}
    step "build $platform"
    KIAMFAST_PLATFORM=$platform "$repo/deploy/image/build.sh" \
        "localhost/kiamfast/release:$version-$arch" \
        >"$work/build-$arch.out" 2>"$work/build-$arch.err" &
    pids+=($!)
done
failed=()
for i in "${!pids[@]}"; do   # both waited for: a failed one leaves no build running
    wait "${pids[i]}" || failed+=("${platforms[i]#linux/}")
done
for arch in "${failed[@]}"; do cat "$work/build-$arch.err" >&2; done
(( ${#failed[@]} == 0 )) || die "the ${failed[*]} build failed (its output above)"
archive=$(tail -n 1 "$work/build-amd64.out")
# build.sh's storage: its storage.conf sits beside the archive it wrote.
export CONTAINERS_STORAGE_CONF="$(dirname "$archive")/storage.conf"

# ---- 2. one index of both, pushed ----
list="localhost/kiamfast/release-list:$version"
buildah manifest rm "$list" >/dev/null 2>&1 || true
buildah manifest create "$list" >/dev/null
for platform in "${platforms[@]}"; do
    buildah manifest add "$list" \
        "containers-storage:localhost/kiamfast/release:$version-${platform#linux/}" >/dev/null
done
step "push $image"
buildah manifest push --quiet --all "${tls[@]}" --digestfile "$work/digest" \
    "$list" "docker://$image"
buildah manifest rm "$list" >/dev/null
digest=$(cat "$work/digest")

# ---- 3. the chart, naming the pushed image ----
cp -r "$repo/deploy/chart/kiamfast" "$work/chart"
grep -rlF ghcr.io/kiamfast/kiamfast "$work/chart" |
    xargs sed -i "s|ghcr\.io/kiamfast/kiamfast|$repository/kiamfast|g"
"$helm" package "$work/chart" --version "$version" --app-version "$version" \
    --destination "$work" >/dev/null
step "push $chart_repo/kiamfast:$version"
"$helm" push "${helm_tls[@]}" "$work/kiamfast-$version.tgz" "$chart_repo" \
    >/dev/null 2>"$work/helm.err" ||
    { cat "$work/helm.err" >&2; die "helm push to $chart_repo failed"; }

echo "chart: $chart_repo/kiamfast --version $version"
echo "image: $image"
echo "$repository/kiamfast@$digest"
