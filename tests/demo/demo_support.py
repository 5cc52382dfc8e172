"""Running ``kiamfast demo`` as a user does: a subprocess, its output, its exit status.

Each run is its own process group (start_new_session), so a run that hangs is ended with
everything it started (the agent, its workers, the pod clients) and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT = 120.0


@dataclass
class DemoRun:
    returncode: int
    stdout: str
    stderr: str
    pid: int


def demo_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["NO_COLOR"] = "1"
    return env


def run_demo(*args: str, timeout: float = DEMO_TIMEOUT) -> DemoRun:
    proc = subprocess.Popen([sys.executable, "-m", "kiamfast", "demo", *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=demo_env(), cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"kiamfast demo did not finish within {timeout:.0f} s\n{out}\n{err}")
    return DemoRun(proc.returncode, out, err, proc.pid)


def leftovers(demo_pid: int) -> tuple[list[str], list[int]]:
    """Files and processes a finished demo (pid ``demo_pid``) left behind."""
    marker = f"kiamfast-demo-{demo_pid}-"
    files = [str(p) for p in Path("/dev/shm").glob(marker + "*")] \
        if Path("/dev/shm").is_dir() else []
    procs = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            procs.append(int(entry.name))
    return files, procs
