#!/usr/bin/env bash
# Build the AWS SDK clients the end-to-end tests run inside pods (tests/e2e/sdk_clients.py):
#
#   $KIAMFAST_TOOLS/sdk-go-<hash>/kiamfast-go-client         AWS SDK for Go v2 (static binary)
#   $KIAMFAST_TOOLS/sdk-java-<hash>/kiamfast-java-client.jar  AWS SDK for Java v2 (one jar)
#
# KIAMFAST_TOOLS defaults to ~/.cache/kiamfast/tools. <hash> is the first 12 hex digits of the
# sha256 of the sources (go.mod + main.go; pom.xml + the .java files in path order), so a
# changed client is rebuilt and an unchanged one never is. Dependencies come from the Go
# module proxy and Maven Central (~/.m2); Maven is tried offline first, so a second machine
# with a warm ~/.m2 needs no network. Each client prints one line: built (with its duration)
# or cached. Needs go and mvn + a JDK 17.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
tools="${KIAMFAST_TOOLS:-$HOME/.cache/kiamfast/tools}"
PATH="$PATH:/usr/local/go/bin"   # where the Go toolchain lives when it is not from apt
mkdir -p "$tools"

# sha256 of the given files (relative to the current directory), concatenated in order.
content_hash() {
  cat "$@" | sha256sum | cut -c1-12
}

seconds_since() {
  awk -v start="$1" -v now="$(date +%s.%N)" 'BEGIN { printf "%.1f", now - start }'
}

need() {
  if ! command -v "$1" >/dev/null; then
    echo "tests/sdk/build.sh: needs $1 ($2)" >&2
    exit 1
  fi
}

build_go() {
  local src="$here/go" hash dest work started
  hash="$(cd "$src" && content_hash go.mod main.go)"
  dest="$tools/sdk-go-$hash"
  if [[ -x "$dest/kiamfast-go-client" ]]; then
    echo "sdk-go: cached $dest/kiamfast-go-client"
    return
  fi
  need go "Go 1.24 or newer"
  started="$(date +%s.%N)"
  # Build into a temporary directory and rename it: a half-finished build never looks done.
  work="$(mktemp -d "$tools/.sdk-go-$hash.XXXXXX")"
  chmod 755 "$work"
  if ! (cd "$src" && CGO_ENABLED=0 nice -n 10 go build -mod=readonly -trimpath \
      -o "$work/kiamfast-go-client" . >"$work/build.log" 2>&1); then
    cat "$work/build.log" >&2
    echo "sdk-go: build failed (log above; work directory $work)" >&2
    exit 1
  fi
  rm "$work/build.log"
  rm -rf "$dest" && mv "$work" "$dest"
  echo "sdk-go: built $dest/kiamfast-go-client in $(seconds_since "$started")s"
}

build_java() {
  local src="$here/java" hash dest work started sources
  mapfile -t sources < <(cd "$src" && find src -type f -name '*.java' | LC_ALL=C sort)
  hash="$(cd "$src" && content_hash pom.xml "${sources[@]}")"
  dest="$tools/sdk-java-$hash"
  if [[ -f "$dest/kiamfast-java-client.jar" ]]; then
    echo "sdk-java: cached $dest/kiamfast-java-client.jar"
    return
  fi
  need mvn "apt-get install maven"
  need java "apt-get install openjdk-17-jdk-headless"
  started="$(date +%s.%N)"
  # Maven writes target/ next to the pom: build in a copy, never in the checkout.
  work="$(mktemp -d "$tools/.sdk-java-$hash.XXXXXX")"
  chmod 755 "$work"
  cp -r "$src/pom.xml" "$src/src" "$work/"
  if ! (cd "$work" && nice -n 10 mvn -B -q -o package >"$work/offline.log" 2>&1); then
    if ! (cd "$work" && nice -n 10 mvn -B -q package >"$work/online.log" 2>&1); then
      cat "$work/online.log" >&2
      echo "sdk-java: build failed (log above; work directory $work)" >&2
      exit 1
    fi
  fi
  mkdir -p "$work/out"
  mv "$work/target/kiamfast-java-client.jar" "$work/out/"
  rm -rf "$dest" && mv "$work/out" "$dest" && rm -rf "$work"
  echo "sdk-java: built $dest/kiamfast-java-client.jar in $(seconds_since "$started")s"
}

build_go
build_java
