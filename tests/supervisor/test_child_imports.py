"""The agent's children import the kiamfast their parent imported (issue 14).

A user installs kiamfast (`pip install .`, not editable) and starts it from wherever they
are, a checkout of the source included.  `python -m ...` puts the working directory first
on sys.path, so children started that way from a checkout imported the checkout's kiamfast,
which has no compiled extensions, and the agent stopped with "workers did not start
listening".  Here: a wheel of this tree, installed into a fresh venv (its dependencies from
the package index), started from a pristine copy of the source (as a fresh clone has it: no
compiled files) and from /, must serve a pod's credentials.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_process import LISTING, POD_IP, ROLE, Agent, Fakes, http

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run(cmd: list[str], **kw) -> None:
    done = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True,
                          timeout=900, **kw)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def source_checkout(dest: Path) -> Path:
    """The tree's files as a clone has them (tracked and new, nothing ignored or built)."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's `kiamfast` command, a pristine source checkout to stand in)."""
    root = tmp_path_factory.mktemp("child-imports")
    checkout = source_checkout(root / "checkout")
    build_tree = source_checkout(root / "build-tree")   # the build leaves build/ behind
    wheels = root / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(build_tree)])
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)])   # plain: not the editable install's
    run([str(venv / "bin" / "pip"), "install", "-q", *map(str, wheels.glob("*.whl"))])
    assert not list((checkout / "kiamfast").glob("*.so"))   # what made children fail
    return venv / "bin" / "kiamfast", checkout


@pytest.fixture(scope="module")
def fakes():
    f = Fakes()
    yield f
    f.stop()


def clean_env() -> dict[str, str]:
    """The user's shell: no PYTHONPATH pointing anywhere (the test runner may set one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


@pytest.mark.parametrize("where", ["checkout", "root"])
def test_installed_agent_serves_from_a_checkout_and_from_root(installed, fakes, tmp_path,
                                                             where):
    command, checkout = installed
    cwd = str(checkout) if where == "checkout" else "/"
    agent = Agent(fakes, tmp_path / "agent", command=[str(command)], cwd=cwd,
                  extra=["--workers=2"], env=clean_env())
    try:
        agent.wait_ready()     # control started, synced and published ready to the workers
        assert http(agent.port, f"GET {LISTING}", source=POD_IP) == (200, ROLE.encode())
    finally:
        assert agent.stop() == 0, agent.log()
    assert "Traceback" not in agent.log()
