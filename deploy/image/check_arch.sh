#!/usr/bin/env bash
# Checks that an image in buildah's storage is of one architecture through and through:
#
#   deploy/image/check_arch.sh IMAGE amd64|arm64
#
# its config's architecture, and the ELF machine of kiamfast's compiled extensions
# (kiamfast/_server*.so, _table*.so in /opt/venv). A build whose base is of another
# architecture than its --platform finishes with only a warning and a config that names the
# platform; the extensions say what was really compiled. Exit 1 with one line saying what is
# wrong. deploy/image/build.sh runs it on every image it builds.
set -euo pipefail
image=${1:?usage: check_arch.sh IMAGE amd64|arm64}
arch=${2:?usage: check_arch.sh IMAGE amd64|arm64}
case $arch in
    amd64) elf_machine=62 ;;    # EM_X86_64
    arm64) elf_machine=183 ;;   # EM_AARCH64
    *) echo "deploy/image/check_arch.sh: $arch: amd64 or arm64" >&2; exit 2 ;;
esac

# (buildah warns when the image is not of this machine's architecture: that is what is checked
# below, in one line)
ctr=$(buildah from --pull-never "$image" 2>/dev/null) ||
    { echo "deploy/image/check_arch.sh: $image: no such image" >&2; exit 2; }
trap 'buildah rm "$ctr" >/dev/null' EXIT
root=$(buildah mount "$ctr")
wrong=()
config_arch=$(buildah inspect --type container --format '{{.OCIv1.Architecture}}' "$ctr")
[[ $config_arch == "$arch" ]] || wrong+=("its config says $config_arch")
mapfile -t extensions < <(compgen -G "$root/opt/venv/lib/python3*/site-packages/kiamfast/_*.so")
(( ${#extensions[@]} >= 2 )) || wrong+=("${#extensions[@]} of kiamfast's extensions, not 2")
for so in "${extensions[@]}"; do
    # e_machine: 2 bytes, little-endian (ELFDATA2LSB on both), at offset 18
    machine=$(od -An -tu2 --endian=little -j18 -N2 "$so" | tr -d ' ')
    [[ $machine == "$elf_machine" ]] || wrong+=("${so##*/} is ELF machine $machine")
done
if (( ${#wrong[@]} )); then
    joined=$(printf '%s; ' "${wrong[@]}")
    echo "deploy/image/check_arch.sh: $image is not $arch (ELF machine $elf_machine):" \
         "${joined%; }" >&2
    exit 1
fi
