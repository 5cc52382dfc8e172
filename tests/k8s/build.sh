#!/usr/bin/env bash
# Builds the real kube-apiserver, kubelet, kube-controller-manager, kube-scheduler and etcd
# that tests/k8s start, and kubectl (pointed at the demo by tests/demo), from the Go module
# proxy only (the modules in tests/k8s/kubernetes and tests/k8s/etcd; nothing vendored), into
# ${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}/<name>-<version>/. A binary already there
# is kept, so a second run costs nothing. Prints one line per binary: wall and CPU time.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The versions are the ones the go.mod files require (kube.py reads them the same way).
required() {  # required <go.mod> <module>
    awk -v m="$2" '($1 == m || ($1 == "require" && $2 == m)) { print ($1 == m) ? $2 : $3 }' "$1"
}
KUBE_VERSION=$(required "$here/kubernetes/go.mod" k8s.io/kubernetes)
ETCD_VERSION=$(required "$here/etcd/go.mod" go.etcd.io/etcd/server/v3)
tools="${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}"
export GOFLAGS=-mod=mod

# build NAME VERSION MODULE_DIR PACKAGE [extra ldflags]: one binary, built into a temp
# name of this process's and renamed, so an interrupted build never leaves a binary the tests
# would trust, and two test runs building at once (a shared tools cache) do not collide.
build() {
    local name=$1 version=$2 module=$3 package=$4 extra=${5:-}
    local out="$tools/$name-$version/$name"
    if [[ -x "$out" ]]; then
        echo "$name $version: present ($out)"
        return
    fi
    command -v go >/dev/null || { echo "tests/k8s/build.sh: $name needs go (1.24+)" >&2; exit 1; }
    mkdir -p "$(dirname "$out")"
    local start=$SECONDS t0 t1
    t0=$(awk '{print $14+$15+$16+$17}' /proc/$$/stat)
    (cd "$here/$module" && nice -n 10 go build -trimpath -ldflags="-s -w $extra" \
        -o "$out.partial.$$" "$package")
    mv "$out.partial.$$" "$out"
    t1=$(awk '{print $14+$15+$16+$17}' /proc/$$/stat)
    local ticks; ticks=$(getconf CLK_TCK)
    echo "$name $version: built in $((SECONDS - start)) s wall," \
        "$(( (t1 - t0) / ticks )) s CPU ($out)"
}

# The version stamp makes /version (and the server's own log) name the real release.
stamp="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION"
stamp+=" -X k8s.io/component-base/version.gitMajor=1"
minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
stamp+=" -X k8s.io/component-base/version.gitMinor=$minor"
stamp+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBE_VERSION"

build etcd "$ETCD_VERSION" etcd kiamfast.test/k8s/etcd
build kube-apiserver "$KUBE_VERSION" kubernetes k8s.io/kubernetes/cmd/kube-apiserver "$stamp"
build kubelet "$KUBE_VERSION" kubernetes k8s.io/kubernetes/cmd/kubelet "$stamp"
# The chart tier (test_chart_install.py): the DaemonSet controller and the scheduler.
build kube-controller-manager "$KUBE_VERSION" kubernetes \
    k8s.io/kubernetes/cmd/kube-controller-manager "$stamp"
build kube-scheduler "$KUBE_VERSION" kubernetes k8s.io/kubernetes/cmd/kube-scheduler "$stamp"
# The client a user points at the demo's API server (tests/demo: the printed kubectl
# line), and the operator's commands of docs/upgrade-and-rollback.md, run as written
# (test_chart_upgrade_and_rollback.py).
build kubectl "$KUBE_VERSION" kubernetes k8s.io/kubernetes/cmd/kubectl "$stamp"
