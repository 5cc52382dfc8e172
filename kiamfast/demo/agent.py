"""The agent under demo: kiamfast itself, unmodified, as a child process tree.

Why it exists: the demo shows the real agent, so it runs ``python -m kiamfast`` with
kube2iam's flags (and kiamfast's for the loopback world) against the demo's cluster
(:mod:`kiamfast.demo.cluster`), with its own log file and shared table, and waits for what
a node waits for: ``/readyz`` and the startup taint removed. The agent's table, mapped
read-only, tells the demo's race scenes when the agent knows an address's owner.

What it must never do: reach AWS or the machine's metadata service (the agent gets static
fake keys and ``AWS_EC2_METADATA_DISABLED=true``), write the agent's table, or leave its
process or table files behind after :meth:`DemoAgent.stop`.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import time
from pathlib import Path
from typing import Any

from kiamfast.demo import scenario
from kiamfast.demo.child_env import clean_env
from kiamfast.demo.cluster import DemoCluster
from kiamfast.demo.errors import AgentDied, DemoError
from kiamfast.testing.aws_env import offline_env
from kiamfast.testing.loopback import AgentProcess, package_root, run_each
from kiamfast.testing.net import ExitedEarly, free_port

__all__ = ["DemoAgent", "REGION"]

REGION = "us-east-1"


class DemoAgent:
    """Start, watch and stop the agent on ``cluster``'s node."""

    def __init__(self, cluster: DemoCluster, *, workdir: Path, workers: int = 1) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.workers = workers
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else workdir
        self.table_path = str(base / f"kiamfast-demo-{os.getpid()}-{secrets.token_hex(4)}")
        self.log = workdir / "agent.log"
        self.port = 0
        self._process: AgentProcess | None = None
        self._table: Any = None

    # ------------------------------------------------------------------ start, readiness

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def argv(self) -> list[str]:
        """The agent's command line: kube2iam's flags, plus kiamfast's for the loopback world."""
        return self.cluster.node.agent_argv(
            port=self.port, table_path=self.table_path,
            token_key_file=str(self.workdir / "token-key"), extra=[
                f"--default-role={scenario.DEFAULT_ROLE}", "--namespace-restrictions",
                f"--sts-region={REGION}", "--listen-host=127.0.0.1",
                f"--workers={self.workers}"])

    def start(self, *, timeout: float = 20.0) -> None:
        """Start the agent and return once it accepts connections."""
        self.port = free_port()
        # The agent's own identity for STS, as the node's instance profile would be.
        env = offline_env(clean_env({}), AWS_ACCESS_KEY_ID="AKIADEMONODEEXAMPLE",
                          AWS_SECRET_ACCESS_KEY="demo-node-secret", AWS_REGION=REGION,
                          PYTHONPATH=package_root())
        # In this process's group: a run that hangs is ended with everything it started.
        self._process = AgentProcess(self.argv(), port=self.port, log_path=self.log,
                                     table_path=self.table_path, env=env, cwd=self.workdir,
                                     own_session=False)
        try:
            self._process.wait_listening(timeout)
        except ExitedEarly as e:
            raise AgentDied(f"the agent exited with status {e.returncode}") from None
        except RuntimeError:
            raise DemoError(f"the agent did not listen on port {self.port} "
                            f"within {timeout:.0f} s") from None

    def check(self) -> None:
        """Raise :class:`AgentDied` if the agent has exited."""
        if self._process is not None:
            try:
                self._process.check()
            except ExitedEarly as e:
                raise AgentDied(f"the agent exited with status {e.returncode}") from None

    def get(self, path: str, *, timeout: float = 2.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_ready(self, *, timeout: float = 30.0) -> float:
        """Wait for ``/readyz`` = 200 and the startup taint gone; returns seconds waited."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            self.check()
            try:
                ready = self.get("/readyz", timeout=1.0)[0] == 200
            except OSError:
                ready = False
            if ready and not self._node_tainted():
                return time.monotonic() - started
            if time.monotonic() > deadline:
                what = "did not report ready" if not ready else "did not remove the node's " \
                                                                  "startup taint"
                raise DemoError(f"the agent {what} within {timeout:.0f} s")
            time.sleep(0.02)

    def _node_tainted(self) -> bool:
        node = self.cluster.api.nodes.get(scenario.NODE)
        taints = (node.get("spec") or {}).get("taints") or []
        return any(t.get("key") == scenario.STARTUP_TAINT for t in taints)

    # ------------------------------------------------------------------ the agent's table

    def _agent_table(self) -> Any:
        """The agent's shared table, mapped read-only (the demo never writes it)."""
        from kiamfast import table

        if self._table is None:
            self._table = table.Table.attach(self.table_path, writer=False)
        return self._table

    def owner_of(self, ip: str) -> str | None:
        """The pod UID the agent's table names for ``ip`` (None: no entry)."""
        from kiamfast import table

        for _ in range(100):
            try:
                found = self._agent_table().lookup_pod(table.ip_key(ip))
                return found[0] if found else None
            except table.TableError:
                time.sleep(0.001)
        return None

    def wait_pending_pods(self, *, timeout: float = 2.0) -> bool:
        """Wait until the agent's table counts a pod waiting for its address."""
        deadline = time.monotonic() + timeout
        while self._agent_table().pending_pods == 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def wait_owner(self, ip: str, uid: str | None, *, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.owner_of(ip) == uid:
                return True
            time.sleep(0.005)
        return self.owner_of(ip) == uid

    # ------------------------------------------------------------------ log, shutdown

    def log_tail(self, lines: int = 15) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return []
        return text.strip().splitlines()[-lines:]

    def stop(self) -> None:
        """Stop the agent, unmap its table and remove the table's files; every step runs
        past one that fails, and the first failure is raised at the end."""
        from kiamfast import table

        errors = run_each([self._stop_process, self._close_table])
        for path in (self.table_path, self.table_path + ".token-key",
                     *table.files_beside(self.table_path)):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if errors:
            raise errors[0]

    def _stop_process(self) -> None:
        if self._process is not None:
            self._process.stop(12)
            self._process = None

    def _close_table(self) -> None:
        if self._table is not None:
            mapped, self._table = self._table, None
            mapped.close()
