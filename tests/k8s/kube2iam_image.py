"""An image that runs the real kube2iam, for installing kube2iam's own chart on a test node.

No registry is reachable, so kube2iam's published image (jtblin/kube2iam, alpine) cannot be
pulled. The binary tests/tools/build_kube2iam.sh builds from kube2iam's source is put into
the image deploy/image/build.sh made from Debian packages (what kube2iam needs beside its
binary is there: iptables for ``--iptables``, and ``/bin/sh``, ``iptables-save``, ``grep``
and ``sed`` for kube2iam-chart's preStop hook), as the entrypoint ``/usr/local/bin/kube2iam``.
buildah works in a storage of its own under $KIAMFAST_TOOLS; the result is an OCI archive
for ``ctr images import``, rebuilt only when the kiamfast archive or the binary changed.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import kube

BUILD_SCRIPT = kube.REPO / "tests" / "tools" / "build_kube2iam.sh"
NAME = "localhost/kube2iam/kube2iam:test"
ENTRYPOINT = "/usr/local/bin/kube2iam"


def kube2iam_binary() -> Path:
    version = re.search(r"^KUBE2IAM_VERSION=(\S+)$", BUILD_SCRIPT.read_text(), re.M).group(1)
    path = kube.tools_dir() / f"kube2iam-{version}" / "kube2iam"
    assert path.is_file(), f"kube2iam is not built ({path}): run {BUILD_SCRIPT}"
    return path


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def kube2iam_image(kiamfast_archive: Path) -> Path:
    """The OCI archive of ``NAME``: kiamfast's image with kube2iam's binary as entrypoint."""
    binary = kube2iam_binary()
    key = hashlib.sha256(f"{_digest(kiamfast_archive)} {_digest(binary)}".encode()).hexdigest()
    work = kube.tools_dir() / "kube2iam-image"
    archive = work / f"kube2iam-{key[:16]}.oci.tar"
    if archive.is_file():
        return archive
    (work / "storage").mkdir(parents=True, exist_ok=True)
    conf = work / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{work}/storage/graph"\n'
                    f'runroot = "{work}/storage/run"\n')
    env = dict(os.environ, CONTAINERS_STORAGE_CONF=str(conf))

    def buildah(*args: str) -> str:
        result = subprocess.run(["buildah", *args], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stderr[-2000:]}"
        return result.stdout.strip()

    container = buildah("from", "--pull-never", "--quiet", f"oci-archive:{kiamfast_archive}")
    try:
        buildah("copy", "--chmod", "0755", container, str(binary), ENTRYPOINT)
        buildah("config", "--entrypoint", f'["{ENTRYPOINT}"]', "--cmd", "", container)
        buildah("commit", "--quiet", container, NAME)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, env=env, timeout=120)
    partial = archive.with_suffix(f".{os.getpid()}.tmp")
    buildah("push", "--quiet", NAME, f"oci-archive:{partial}:{NAME}")
    # The storage's copies are not needed once the archive exists (and a session's kiamfast
    # image is new every build): drop them, and the archives of earlier inputs.
    subprocess.run(["buildah", "rmi", "--all", "--force"], capture_output=True, env=env,
                   timeout=300)
    for old in work.glob("kube2iam-*.oci.tar"):
        old.unlink()
    partial.rename(archive)
    return archive
