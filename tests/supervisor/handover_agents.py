"""Agents of one node on loopback that hand the node over (--handover-socket), each with
its own workdir, log and ready file, sharing the table, the token key and the handover
socket as the pods of one DaemonSet share the chart's hostPath; and pods asking all along
(tests/steady_calls.py)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent_process import POD_IP, ROLE, Agent, Fakes
from steady_calls import Call, Caller, summary
from kiamfast.testing.sts import FaultProxy


class Node:
    """The fakes (with STS behind a recording proxy) and the node's shared state dir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state, 0o700)
        self.fakes = Fakes()
        self.fakes.proxy = FaultProxy(self.fakes.sts.url).start()
        self.agents: list[Agent] = []
        self.port: int | None = None

    def close(self) -> None:
        for agent in self.agents:
            agent.stop()
        self.fakes.proxy.stop()
        self.fakes.stop()

    def agent(self, name: str, *, extra: list[str] = (), handover: bool = True,
              keeper: str | None = None) -> Agent:
        workdir = self.root / name
        flags = [f"--sts-endpoint={self.fakes.proxy.url}",
                 f"--table-path={self.state / 'table'}",
                 f"--token-key-file={self.state / 'token-key'}",
                 f"--ready-file={workdir / 'ready'}"]
        if handover:
            flags.append(f"--handover-socket={self.state / 'handover.sock'}")
        if keeper:
            flags.append(f"--socket-keeper={keeper}")
        agent = Agent(self.fakes, workdir, port=self.port, extra=[*flags, *extra])
        agent.name = name
        agent.ready_path = workdir / "ready"
        self.port = agent.port
        self.agents.append(agent)
        return agent

    def callers(self, *, fresh: int = 2, keep_alive: int = 2, interval: float = 0.02,
                timeout: float = 1.0) -> list[Caller]:
        out = [Caller("127.0.0.1", self.port, ROLE, source=POD_IP, keep_alive=k,
                      interval=interval, timeout=timeout)
               for k in [False] * fresh + [True] * keep_alive]
        for caller in out:
            caller.start()
        return out

    def role_of(self, access_key: str | None) -> str | None:
        for call in self.fakes.proxy.assume_role_calls():
            if call.access_key_id == access_key:
                return call.role_arn.rsplit("/", 1)[1]
        return None

    def wrong(self, calls: list[Call]) -> list[Call]:
        """Calls not answered with the pod's own role."""
        return [c for c in calls if not c.ok or self.role_of(c.access_key) != ROLE]


def wait_until(condition, what, timeout: float = 60.0) -> None:
    """Wait for ``condition()``; fail with ``what`` (a string, or a callable giving one when
    it fails: an agent's log as it is then)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(what() if callable(what) else what)
        time.sleep(0.02)


def serving(agent: Agent) -> bool:
    """Its own control process is ready (its ready file)."""
    return agent.ready_path.exists()


def idle(agent: Agent) -> bool:
    return agent.proc.poll() is None and not agent.children("kiamfast.control") \
        and not agent.children("kiamfast.server.worker")


def kill_tree(agent: Agent) -> None:
    """SIGKILL the agent's whole process group (its container, killed)."""
    os.killpg(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()


def start_keeper(path: str) -> subprocess.Popen:
    """A socket keeper (`kiamfast keep-sockets`) at ``path``, listening."""
    proc = subprocess.Popen([sys.executable, "-m", "kiamfast", "keep-sockets", "--socket", path],
                            stderr=subprocess.PIPE, text=True)
    wait_until(lambda: os.path.exists(path) or proc.poll() is not None, "no keeper socket")
    assert proc.poll() is None, proc.stderr.read()
    return proc


WRITER = re.compile(r"table writer (from|until) (\d+) pid=(\d+)")


def writer_terms(agents: list[Agent]) -> list[tuple[int, int, int]]:
    """(pid, from, until) of every control process that wrote the table, from the agents'
    logs; a writer that has not ended (or was killed) ends now."""
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for agent in agents:
        for kind, ns, pid in WRITER.findall(agent.log()):
            (starts if kind == "from" else ends)[int(pid)] = int(ns)
    now = time.monotonic_ns()
    return sorted((pid, start, ends.get(pid, now)) for pid, start in starts.items())


def overlapping(terms: list[tuple[int, int, int]]) -> list[tuple]:
    by_start = sorted(terms, key=lambda t: t[1])
    return [(a, b) for a, b in zip(by_start, by_start[1:]) if b[1] < a[2]]


__all__ = ["Node", "POD_IP", "ROLE", "kill_tree", "idle", "overlapping", "serving",
           "start_keeper", "summary", "wait_until", "writer_terms"]
