"""The demo's pods: one short-lived client process each, started, run and stopped here.

Why it exists: a pod is what the agent serves, so the demo plays each pod with a real
botocore client (:mod:`kiamfast.demo.pod`, run as ``python -m kiamfast.demo.pod``) whose
connections leave from the pod's 127/8 address, with the agent as its metadata endpoint and
the demo's STS to check what it received. This module is the parent's side: it starts those
processes, tells each when to make its first call and collects its report.

What it must never do: let a pod's client find credentials anywhere but the agent (its
environment holds no AWS settings of the user's, :mod:`kiamfast.demo.child_env`), or leave a
process behind after :meth:`DemoPods.stop`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kiamfast.demo.agent import DemoAgent
from kiamfast.demo.child_env import clean_env
from kiamfast.demo.cluster import DemoCluster
from kiamfast.testing.loopback import package_root

__all__ = ["DemoPods", "PodProcess"]

POD_TIMEOUT = 20.0


class PodProcess:
    """One pod client process (:mod:`kiamfast.demo.pod` with ``--wait-for-go``).

    Protocol: the process prints ``ready`` once botocore is imported and its connections are
    bound to the pod's address, makes its first call when it reads a line on stdin, prints
    its report as one JSON line and exits. Every failure becomes a report with ``crashed``.
    """

    def __init__(self, ip: str, argv: list[str], *, env: dict[str, str], cwd: Path) -> None:
        self.ip = ip
        self.crashed: str | None = None
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=cwd, bufsize=0)

    def wait_ready(self, *, timeout: float = POD_TIMEOUT) -> bool:
        line = self._read_line(timeout)
        if line != b"ready":
            self.crashed = self._why("did not get ready")
            self.kill()
        return self.crashed is None

    def go(self, *, timeout: float = POD_TIMEOUT) -> dict:
        """Make the first call now; returns the report."""
        if self.crashed is None:
            try:
                self.proc.stdin.write(b"go\n")
                self.proc.stdin.close()
            except OSError:
                pass
            line = self._read_line(timeout)
            try:
                report = json.loads(line or b"")
                if isinstance(report, dict):
                    self.proc.wait(timeout=5)
                    return report
            except (ValueError, subprocess.TimeoutExpired):
                pass
            self.crashed = self._why("gave no report")
        self.kill()
        return {"ip": self.ip, "crashed": self.crashed}

    def _read_line(self, timeout: float) -> bytes | None:
        """One line from stdout within ``timeout`` (None: EOF or timeout)."""
        import selectors

        deadline = time.monotonic() + timeout
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    return None
                buf += chunk
        return buf.split(b"\n", 1)[0].strip()

    def _why(self, what: str) -> str:
        self.kill()
        try:
            err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            err = []
        code = self.proc.returncode
        return f"{what} (exit {code}{': ' + err[-1] if err else ''})"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


class DemoPods:
    """The pod client processes the demo starts, each asking ``agent`` for its credentials
    and checking them with ``cluster``'s STS."""

    def __init__(self, *, workdir: Path, agent: DemoAgent, cluster: DemoCluster) -> None:
        self.workdir = workdir
        self.agent = agent
        self.cluster = cluster
        self._running: list[PodProcess] = []

    def spawn(self, ip: str) -> PodProcess:
        """Start a pod client from ``ip``, ready to make its first call on
        :meth:`PodProcess.go`."""
        home = self.workdir / "home"
        home.mkdir(exist_ok=True)
        env = clean_env({
            "HOME": str(home),
            "PYTHONPATH": package_root(),
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": self.agent.url,
        })
        pod = PodProcess(ip, self._argv(ip) + ["--wait-for-go"], env=env, cwd=home)
        self._running.append(pod)
        return pod

    def run(self, ip: str) -> dict:
        """Run one pod client from ``ip``; returns its report (``crashed`` if it had none)."""
        pod = self.spawn(ip)
        pod.wait_ready()
        return pod.go()

    def run_all(self, ips: list[str]) -> list[dict]:
        """Start the pod clients together, then let each make its call in turn: start-up
        is paid in parallel, and no call's latency includes another process' CPU work."""
        pods = [self.spawn(ip) for ip in ips]
        for pod in pods:
            pod.wait_ready()
        return [pod.go() for pod in pods]

    def stop(self) -> None:
        for pod in self._running:
            pod.kill()
        self._running.clear()

    def _argv(self, ip: str) -> list[str]:
        return [sys.executable, "-m", "kiamfast.demo.pod", "--ip", ip,
                "--imds", self.agent.url, "--sts-endpoint", self.cluster.sts_url]
