"""``kiamfast --version`` of a pip-installed wheel names the commit it was built from.

The wheel is built here from a clone of this checkout (what a user's ``pip wheel`` of the
repository sees), installed with pip into a fresh venv, and run from ``/`` with no
``KIAMFAST_GIT_COMMIT`` in its environment: the commit can only come from the build.
The image's stamp (its environment) is tests/deploy/test_image.py's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import kiamfast

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def head_commit_and_date() -> tuple[str, str]:
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %ct"],
                         capture_output=True, text=True, timeout=30, check=True).stdout.split()
    return out[0], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(out[1])))


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("version-wheel")
    source = d / "source"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(source)],
                   check=True, timeout=300)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KIAMFAST_GIT_COMMIT", "KIAMFAST_BUILD_DATE", "SOURCE_DATE_EPOCH")}
    wheels = d / "wheels"
    build = subprocess.run(
        ["nice", "-n", "10", sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
         "--no-build-isolation", "--wheel-dir", str(wheels), str(source)],
        capture_output=True, text=True, timeout=900, env=env)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("kiamfast-*.whl")
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=900,
                             env=dict(env, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return wheel, venv


def test_the_wheel_carries_the_commit_it_was_built_from(installed):
    wheel, _ = installed
    commit, date = head_commit_and_date()
    stamp = zipfile.ZipFile(wheel).read("kiamfast/_build_stamp.py").decode()
    assert f"COMMIT = {commit!r}" in stamp and f"DATE = {date!r}" in stamp, stamp


def test_version_of_the_installed_wheel_names_the_commit(installed):
    _, venv = installed
    commit, date = head_commit_and_date()
    result = subprocess.run([str(venv / "bin" / "kiamfast"), "--version"], capture_output=True,
                            text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (f"Version: {kiamfast.__version__} - Commit: {commit} - "
                             f"Date: {date}\n")
    # The image's stamp (its environment) still wins over the wheel's.
    result = subprocess.run([str(venv / "bin" / "kiamfast"), "--version"], capture_output=True,
                            text=True, timeout=60, cwd="/",
                            env={"PATH": "/usr/bin:/bin", "KIAMFAST_GIT_COMMIT": "abc1234",
                                 "KIAMFAST_BUILD_DATE": "2026-12-01T00:00:00Z"})
    assert result.stdout.endswith("Commit: abc1234 - Date: 2026-12-01T00:00:00Z\n")


def test_the_wheel_carries_the_apache_license(installed):
    """pyproject.toml says Apache-2.0; the wheel carries the license's text (LICENSE)."""
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    (license_file,) = [n for n in names if ".dist-info/" in n and n.endswith("/LICENSE")]
    text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert text == (REPO / "LICENSE").read_text()
    metadata = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Apache-2.0" in metadata
