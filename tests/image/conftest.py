"""Fixtures of the image tests: the image deploy/image/build.sh builds, run by a real
containerd.

The image is built once per session with the project's own build script (buildah, a
debian:bookworm-slim base made from Debian packages, everything cached under
$KIAMFAST_TOOLS), exported as an OCI archive and imported with ``ctr images import`` into the
tests' containerd (tests/cri/containerd.py), which runs inside a fresh network namespace
standing for the node. ``ctr run --net-host`` then puts a container in that namespace, as the
DaemonSet's hostNetwork pod is on a node. Without root, buildah, mmdebstrap or containerd the
tests skip naming what is missing (in CI the skip policy fails them).
"""
from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "cri"))

from containerd import Containerd, NodeNetns, unavailable_reason  # noqa: E402
from needs import missing_tool, not_root_reason  # noqa: E402

REPO = TESTS.parent
BUILD = REPO / "deploy" / "image" / "build.sh"
IMAGE = "localhost/kiamfast/kiamfast:test"
CTR_NAMESPACE = "kiamfast-image"


def missing_build_tools() -> str | None:
    return (not_root_reason("buildah builds and containerd runs the image")
            or missing_tool("buildah", "mmdebstrap") or unavailable_reason())


@pytest.fixture(scope="session")
def image_archive() -> Path:
    """The OCI archive of the image built from this checkout."""
    reason = missing_build_tools()
    if reason:
        pytest.skip(reason)
    result = subprocess.run(["nice", "-n", "10", str(BUILD), IMAGE], capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return Path(result.stdout.splitlines()[-1])


class ImageRunner:
    """``ctr run`` of the imported image in the node's network namespace."""

    def __init__(self, runtime: Containerd, node: NodeNetns) -> None:
        self.runtime = runtime
        self.node = node

    def ctr(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "-a", str(self.runtime.socket), "-n", CTR_NAMESPACE,
                               *argv], capture_output=True, text=True, timeout=timeout)

    def run(self, argv: Sequence[str], *, caps: Sequence[str] = ()) -> subprocess.CompletedProcess:
        """Run ``argv`` (the whole command line: ctr replaces the entry point) in a fresh
        container on the node's network, with ``caps`` added to ctr's default set."""
        container = f"kf-image-{secrets.token_hex(4)}"
        options = ["--rm", "--net-host", "--runc-root", str(self.runtime.dir / "runc"),
                   # under the containerd's cgroup parent, which its cleanup removes
                   "--cgroup", f"{self.runtime.cgroup_parent}/{container}"]
        for cap in caps:
            options += ["--cap-add", cap]
        return self.ctr("run", *options, IMAGE, container, *argv)


@pytest.fixture(scope="session")
def image(image_archive) -> ImageRunner:
    node = NodeNetns()
    runtime = Containerd(netns=node.name, subnet="10.89.0.0/24")
    try:
        runtime.start()
        runner = ImageRunner(runtime, node)
        imported = runner.ctr("images", "import", str(image_archive))
        assert imported.returncode == 0, imported.stderr
        yield runner
    finally:
        runtime.close()
        node.delete()
