#!/bin/sh
# Installs what tests/cri needs on a fresh Debian machine: a real containerd, runc and the
# CNI plugins (bridge, host-local in /usr/lib/cni). Idempotent and quiet; needs root.
# gcc (for the pause program) is expected from the machine's base toolchain.
set -eu

missing=""
command -v containerd >/dev/null 2>&1 || missing="$missing containerd"
command -v runc >/dev/null 2>&1 || missing="$missing runc"
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] \
    || missing="$missing containernetworking-plugins"
command -v gcc >/dev/null 2>&1 || missing="$missing gcc libc6-dev"
command -v nsenter >/dev/null 2>&1 || missing="$missing util-linux"

[ -z "$missing" ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
    echo "tests/cri/setup.sh: needs root to install:$missing" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# apt's chatter (debconf notes included) is shown only when something fails
# shellcheck disable=SC2086
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $missing; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "tests/cri/setup.sh: could not install:$missing" >&2
    exit 1
fi
