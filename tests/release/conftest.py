"""Fixtures of the release test: deploy/release.sh run against a real registry on loopback.

``registry`` is Debian's docker-registry on a free port of 127.0.0.1 (tests/release/registry.py);
``release`` runs ``deploy/release.sh --plain-http VERSION 127.0.0.1:PORT/kiamfast`` once per
session with the helm that tests/tools/build_helm.sh builds. The images are built by
deploy/image/build.sh in its cache under $KIAMFAST_TOOLS, the storage the image and kubelet
tiers built linux/amd64 into (so that one is a cache hit); linux/arm64 is built emulated
(qemu-user-static, registered by tests/run), the slow part: a session that will run the
release test starts that build in the background as soon as it has collected, so it overlaps
the tests before; deploy/release.sh's own arm64 build then waits for it (build.sh's lock per
architecture) and finds every layer cached. ``pulled`` is a buildah storage of its own, empty
at the start, so a pull really downloads from the registry.

Without root, buildah, docker-registry, helm or the arm64 emulation the tests skip, naming what
is missing (in CI the skip policy fails them).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "release"))

from needs import missing_tool, not_root_reason  # noqa: E402
from registry import Registry  # noqa: E402

from kiamfast import __version__  # noqa: E402

REPO = TESTS.parent
RELEASE = REPO / "deploy" / "release.sh"
BUILD = REPO / "deploy" / "image" / "build.sh"
HELM_VERSION = "v3.19.5"   # tests/tools/build_helm.sh


def tools_dir() -> Path:
    return Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")


def helm_binary() -> Path:
    return tools_dir() / f"helm-{HELM_VERSION}" / "helm"


def missing_reason() -> str | None:
    reason = (not_root_reason("buildah builds and pulls the images")
              or missing_tool("buildah", "mmdebstrap", "docker-registry", "arch-test"))
    if reason:
        return reason
    if not helm_binary().is_file():
        return f"needs helm ({helm_binary()}): run tests/tools/build_helm.sh"
    emulator = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if os.uname().machine == "x86_64" and not emulator.exists():
        return ("needs qemu-aarch64 registered with binfmt_misc for the arm64 build: run "
                "tests/run as root (apt-get install qemu-user-static binfmt-support)")
    return None


def helm_env(home: Path) -> dict[str, str]:
    """helm with its cache, config (registry logins) and data in ``home``, not the user's."""
    return dict(os.environ, HELM_CACHE_HOME=str(home / "cache"),
                HELM_CONFIG_HOME=str(home / "config"), HELM_DATA_HOME=str(home / "data"))


_arm64_prebuild: subprocess.Popen | None = None


def pytest_collection_finish(session):
    """The arm64 build, started in the background when the release test will run."""
    global _arm64_prebuild
    if (session.config.option.collectonly or missing_reason()
            or not any(item.path.name == "test_release.py" for item in session.items)):
        return
    log = tools_dir() / "release-arm64-prebuild.log"
    with log.open("wb") as out:
        _arm64_prebuild = subprocess.Popen(
            ["nice", "-n", "19", str(BUILD), "localhost/kiamfast/prebuild:arm64"],
            env=dict(os.environ, KIAMFAST_PLATFORM="linux/arm64"), stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session):
    """A session that ended before the release test ran leaves no build behind."""
    if _arm64_prebuild is not None and _arm64_prebuild.poll() is None:
        os.killpg(_arm64_prebuild.pid, signal.SIGTERM)
        try:
            _arm64_prebuild.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(_arm64_prebuild.pid, signal.SIGKILL)
            _arm64_prebuild.wait()


@dataclass
class Release:
    registry: Registry
    version: str
    repository: str        # what deploy/release.sh was given: 127.0.0.1:PORT/kiamfast
    digest: str            # the index digest it printed
    output: str
    seconds: float
    helm_home: Path

    @property
    def image(self) -> str:
        return f"{self.repository}/kiamfast"

    @property
    def chart(self) -> str:
        return f"oci://{self.repository}/charts/kiamfast"

    def helm(self, *args: str, timeout: float = 120) -> str:
        result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True,
                                env=helm_env(self.helm_home), timeout=timeout)
        assert result.returncode == 0, f"helm {' '.join(args)}: {result.stderr}"
        return result.stdout


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    registry = Registry(tmp_path_factory.mktemp("registry"))
    try:
        yield registry
    finally:
        registry.close()


@pytest.fixture(scope="session")
def release(registry, tmp_path_factory) -> Release:
    """deploy/release.sh, run once: both images and the chart pushed to ``registry``."""
    repository = f"{registry.host}/kiamfast"
    helm_home = tmp_path_factory.mktemp("helm")
    started = time.monotonic()
    result = subprocess.run(
        ["nice", "-n", "10", str(RELEASE), "--plain-http", __version__, repository],
        capture_output=True, text=True, timeout=3600,
        env=dict(helm_env(helm_home), HELM=str(helm_binary())))
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    last = result.stdout.splitlines()[-1]
    match = re.fullmatch(rf"{re.escape(repository)}/kiamfast@(sha256:[0-9a-f]{{64}})", last)
    assert match, result.stdout
    print(f"deploy/release.sh took {seconds:.0f} s")
    return Release(registry=registry, version=__version__, repository=repository,
                   digest=match.group(1), output=result.stdout, seconds=seconds,
                   helm_home=helm_home)


class PullStorage:
    """buildah with a storage of its own (empty at first) in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        (directory / "graph").mkdir(parents=True)
        (directory / "run").mkdir()
        self.conf = directory / "storage.conf"
        self.conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{directory}/graph"\n'
                             f'runroot = "{directory}/run"\n')

    def buildah(self, *args: str, timeout: float = 600) -> str:
        result = subprocess.run(["buildah", *args], capture_output=True, text=True,
                                timeout=timeout,
                                env=dict(os.environ, CONTAINERS_STORAGE_CONF=str(self.conf)))
        assert result.returncode == 0, f"buildah {' '.join(args)}: {result.stderr[-3000:]}"
        return result.stdout

    def close(self) -> None:
        subprocess.run(["buildah", "rm", "--all"], capture_output=True, timeout=120,
                       env=dict(os.environ, CONTAINERS_STORAGE_CONF=str(self.conf)))
        # containers/storage keeps its overlay directory bind-mounted private
        subprocess.run(["umount", "-R", str(self.dir / "graph" / "overlay")],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pulled(registry, tmp_path_factory):
    storage = PullStorage(tmp_path_factory.mktemp("pulled") / "storage")
    try:
        yield storage
    finally:
        storage.close()
