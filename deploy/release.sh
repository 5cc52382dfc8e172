#!/usr/bin/env bash
# Cuts a release: the image for linux/amd64 and linux/arm64 as one multi-arch index, and the
# Helm chart as an OCI artifact, both pushed to a registry you name.
#
#   deploy/release.sh [--builder buildah|docker] [--plain-http] [--dry-run] VERSION REPOSITORY
#   deploy/release.sh 0.1.0 123456789012.dkr.ecr.eu-west-1.amazonaws.com
#       # -> <that>/kiamfast:0.1.0 and oci://<that>/charts/kiamfast 0.1.0
#   deploy/release.sh --help
#
# VERSION is kiamfast's own (kiamfast/__init__.py), optionally with a pre-release suffix
# (0.1.0-rc.1): the image tag, the chart's version and its appVersion. REPOSITORY is a
# registry host and path; log in first (buildah login / docker login, and helm registry
# login). The git tag of a release is vVERSION (CHANGELOG.md).
#
# --builder buildah (the default): as root on Debian (buildah, mmdebstrap, qemu-user-static
#   for the other architecture); no docker engine. 16 min cold on 2 cores, 40 s unchanged.
#   1. deploy/image/build.sh for each platform, in parallel (a base per architecture);
#      the architecture that is not the machine's runs emulated (qemu-user-static, with
#      binfmt_misc). Each build checks its extensions are of its architecture.
#   2. `buildah manifest create/add` of both into one index, `buildah manifest push --all`
#      as REPOSITORY/kiamfast:VERSION.
# --builder docker: `docker buildx build --platform linux/amd64,linux/arm64 --push` of the
#   Dockerfile, on the buildx builder you have (docker-container, or a remote one; the
#   other architecture emulated by the builder's QEMU or built on a native node).
# Then, either way:
#   3. The chart, with REPOSITORY/kiamfast as its image wherever it names
#      ghcr.io/kiamfast/kiamfast (values and the kube2iam-image swap), `helm package` with
#      version = appVersion = VERSION, `helm push` to oci://REPOSITORY/charts.
#
# --dry-run checks the arguments and the tools and prints every command it would run, one a
#   line, shell-quoted; it builds, pushes and changes nothing.
# --plain-http talks HTTP to the registry (a registry on loopback, as the tests run one;
#   buildah only).
#
# HELM names the helm binary (default: helm on PATH); KIAMFAST_CA_BUNDLE the CA bundle the
# build's pip trusts (default /etc/ssl/certs/ca-certificates.crt). The last line of output is
# the image's reference by digest. Exit 2: a bad argument or a missing tool; 1: a step failed.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
platforms=(linux/amd64 linux/arm64)
usage="usage: deploy/release.sh [--builder buildah|docker] [--plain-http] [--dry-run] VERSION REPOSITORY"
fail() { echo "deploy/release.sh: $*" >&2; exit 2; }   # a bad argument or a missing tool
die() { echo "deploy/release.sh: $*" >&2; exit 1; }    # a step that failed

plain_http=false dry_run=false builder=buildah
args=()
while (( $# )); do
    case $1 in
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        --plain-http) plain_http=true ;;
        --dry-run) dry_run=true ;;
        --builder=*) builder=${1#--builder=} ;;
        --builder) (( $# > 1 )) || fail "--builder needs buildah or docker ($usage)"
                   builder=$2; shift ;;
        -*) fail "unknown flag: $1 ($usage)" ;;
        *) args+=("$1") ;;
    esac
    shift
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
case $builder in
    buildah) command -v buildah >/dev/null ||
                 fail "needs buildah (apt-get install buildah mmdebstrap), or --builder docker" ;;
    docker) $plain_http && fail "--plain-http: buildah only (configure your buildx builder's" \
                                "registry instead)"
            docker buildx version >/dev/null 2>&1 ||
                fail "needs docker with the buildx plugin (docker buildx version), or" \
                     "--builder buildah" ;;
    *) fail "--builder $builder: buildah or docker" ;;
esac
helm=${HELM:-helm}
command -v "$helm" >/dev/null || fail "needs helm (HELM=$helm)"

image="$repository/kiamfast:$version"
chart_repo="oci://$repository/charts"
ca_bundle=${KIAMFAST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
tls=(); helm_tls=()
if $plain_http; then tls=(--tls-verify=false); helm_tls=(--plain-http); fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { printf 'deploy/release.sh: %s\n' "$*" >&2; }
# A command run, or with --dry-run printed (shell-quoted, one a line, on the script's own
# stdout even where the command's is discarded) and not run.
exec 3>&1
run() {
    if $dry_run; then printf '%q ' "$@" | sed 's/ $//' >&3; echo >&3; else "$@"; fi
}
if $dry_run; then
    step "dry run ($builder): the commands a release would run; nothing is built or pushed"
elif [[ -n $(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    step "warning: uncommitted changes are built in; the image names commit" \
         "$(git -C "$repo" rev-parse --short HEAD)"
fi

# ---- 1 and 2 with buildah: each platform in the build script's own storage, one index ----
buildah_release() {
    local pids=() failed=() platform arch i
    for platform in "${platforms[@]}"; do
        arch=${platform#linux/}
        step "build $platform"
        if $dry_run; then
            run env "KIAMFAST_PLATFORM=$platform" "$repo/deploy/image/build.sh" \
                "localhost/kiamfast/release:$version-$arch"
            continue
        fi
        KIAMFAST_PLATFORM=$platform "$repo/deploy/image/build.sh" \
            "localhost/kiamfast/release:$version-$arch" \
            >"$work/build-$arch.out" 2>"$work/build-$arch.err" &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do   # both waited for: a failed one leaves no build running
        wait "${pids[i]}" || failed+=("${platforms[i]#linux/}")
    done
    for arch in "${failed[@]}"; do cat "$work/build-$arch.err" >&2; done
    (( ${#failed[@]} == 0 )) || die "the ${failed[*]} build failed (its output above)"
    if ! $dry_run; then
        # build.sh's storage: its storage.conf sits beside the archive it wrote.
        CONTAINERS_STORAGE_CONF="$(dirname "$(tail -n 1 "$work/build-amd64.out")")/storage.conf"
        export CONTAINERS_STORAGE_CONF
    fi
    local list="localhost/kiamfast/release-list:$version"
    $dry_run || buildah manifest rm "$list" >/dev/null 2>&1 || true
    run buildah manifest create "$list" >/dev/null
    for platform in "${platforms[@]}"; do
        run buildah manifest add "$list" \
            "containers-storage:localhost/kiamfast/release:$version-${platform#linux/}" >/dev/null
    done
    step "push $image"
    run buildah manifest push --quiet --all "${tls[@]}" --digestfile "$work/digest" \
        "$list" "docker://$image"
    run buildah manifest rm "$list" >/dev/null
}

# ---- 1 and 2 with docker buildx: both platforms in one build, pushed as one index --------
docker_release() {
    local commit epoch
    commit=$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)
    epoch=$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)
    step "build and push $image (${platforms[*]})"
    run docker buildx build --platform "$(IFS=,; echo "${platforms[*]}")" \
        --secret "id=ca-certificates,src=$ca_bundle" \
        --build-arg "GIT_COMMIT=$commit" \
        --build-arg "BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
        --build-arg "SOURCE_DATE_EPOCH=$epoch" \
        --metadata-file "$work/metadata.json" --tag "$image" --push \
        --file "$repo/Dockerfile" "$repo"
    $dry_run || sed -n 's/.*"containerimage.digest": *"\(sha256:[0-9a-f]*\)".*/\1/p' \
        "$work/metadata.json" | head -n 1 >"$work/digest"
}

"${builder}_release"
digest=$($dry_run && echo "sha256:<the pushed index's digest>" || cat "$work/digest")
[[ -n $digest ]] || die "the push printed no digest"

# ---- 3. the chart, naming the pushed image ----
cp -r "$repo/deploy/chart/kiamfast" "$work/chart"
grep -rlF ghcr.io/kiamfast/kiamfast "$work/chart" |
    xargs sed -i "s|ghcr\.io/kiamfast/kiamfast|$repository/kiamfast|g"
run "$helm" package "$work/chart" --version "$version" --app-version "$version" \
    --destination "$work" >/dev/null
step "push $chart_repo/kiamfast:$version"
if $dry_run; then
    run "$helm" push "${helm_tls[@]}" "$work/kiamfast-$version.tgz" "$chart_repo"
else
    "$helm" push "${helm_tls[@]}" "$work/kiamfast-$version.tgz" "$chart_repo" \
        >/dev/null 2>"$work/helm.err" ||
        { cat "$work/helm.err" >&2; die "helm push to $chart_repo failed"; }
fi

echo "chart: $chart_repo/kiamfast --version $version"
echo "image: $image"
echo "$repository/kiamfast@$digest"
