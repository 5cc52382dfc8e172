"""deploy/release.sh and deploy/image/build.sh refuse bad arguments before building anything:
exit 2, nothing on stdout, one line naming what is wrong."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kiamfast import __version__

REPO = Path(__file__).resolve().parents[2]
RELEASE = REPO / "deploy" / "release.sh"
BUILD = REPO / "deploy" / "image" / "build.sh"


def refused(argv: list[str], **env: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                            env={**os.environ, "HELM": "true", **env})
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    (line,) = result.stderr.splitlines()
    return line


@pytest.mark.parametrize("args, says", [
    ([], "usage: deploy/release.sh [--plain-http] VERSION REPOSITORY"),
    ([__version__], "usage: deploy/release.sh [--plain-http] VERSION REPOSITORY"),
    (["--plain-http", __version__, "reg.example/kiamfast", "extra"], "usage: "),
    (["--insecure", __version__, "reg.example/kiamfast"], "unknown flag: --insecure"),
    (["v" + __version__, "reg.example/kiamfast"], f"VERSION v{__version__}: not a version"),
    ([__version__ + "+build.1", "reg.example/kiamfast"], "not a version like 0.1.0"),
    (["99.0.0", "reg.example/kiamfast"],
     f"VERSION 99.0.0: kiamfast is {__version__} (kiamfast/__init__.py): bump it first"),
    ([__version__, "https://reg.example/kiamfast"], "REPOSITORY https://reg.example/kiamfast: "),
    ([__version__, "Reg.Example/Kiamfast"], "not a registry host and path"),
])
def test_release_refuses_bad_arguments_in_one_line(args, says):
    line = refused([str(RELEASE), *args])
    assert line.startswith("deploy/release.sh: ") and says in line, line


def test_release_without_helm_says_so():
    line = refused([str(RELEASE), __version__, "reg.example/kiamfast"],
                   HELM="/nonexistent/helm")
    assert line == "deploy/release.sh: needs helm (HELM=/nonexistent/helm)"


def test_build_refuses_a_platform_it_does_not_build():
    line = refused([str(BUILD), "localhost/kiamfast/kiamfast:x"], KIAMFAST_PLATFORM="linux/s390x")
    assert line == ("deploy/image/build.sh: KIAMFAST_PLATFORM=linux/s390x: linux/amd64 or "
                    "linux/arm64")
