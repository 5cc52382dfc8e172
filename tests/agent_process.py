"""The real agent (`kiamfast`: supervisor, workers, control) on loopback with the fakes.

The cluster is the API server emulator, STS is moto on loopback, the metadata service is the
fake IMDS; pods are loopback source addresses.  AWS clients run with static credentials and
AWS_EC2_METADATA_DISABLED, so nothing leaves the machine.  Used wherever a test needs the
whole agent: tests/agent, tests/supervisor, tests/deploy/test_dashboard.py,
tests/server/test_token_key_file.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kiamfast.testing.apiserver import ApiServer
from kiamfast.testing.fake_imds import FakeImds
from kiamfast.testing.sts import MotoSts

POD_IP = "127.0.0.5"
ROLE = "app-role"
LISTING = "/latest/meta-data/iam/security-credentials/"


def free_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        return s.getsockname()[1]


def exchange(port: int, method: str, path: str, *, source: str = "127.0.0.1",
             headers: dict[str, str] | None = None, timeout: float = 5.0) -> bytes:
    """One request on a fresh connection from ``source``; the raw response."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                  source_address=(source, 0)) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 169.254.169.254\r\n{extra}"
                  "Connection: close\r\n\r\n".encode())
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    return raw


def http(port: int, request: str, *, source: str = "127.0.0.1",
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request ("GET /path" or "PUT /path") on a fresh connection; (status, body)."""
    method, path = request.split(" ", 1)
    head, _, body = exchange(port, method, path, source=source,
                             headers=headers).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


class Fakes:
    """The emulated cluster (one node, one pod with a role), STS and metadata service."""

    def __init__(self, *, taints: list[dict] | None = None) -> None:
        self.api = ApiServer().start()
        self.sts = MotoSts()
        self.sts.start()
        self.imds = FakeImds().start()
        self.api.add_node("n1", taints=taints)
        self.api.create_pod("team", "app", node="n1", annotations={
            "iam.amazonaws.com/role": ROLE}, ips=[POD_IP], phase="Running")

    def stop(self) -> None:
        self.imds.stop()
        self.sts.stop()
        self.api.stop()


class Agent:
    """One start of the agent; `wait_ready` until /readyz says 200, `stop` with SIGTERM."""

    def __init__(self, fakes: Fakes, workdir: Path, *, command: list[str] | None = None,
                 cwd: str | None = None, extra: list[str] = (), port: int | None = None,
                 metrics_port: int | None = None, env: dict[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.log_path = workdir / "agent.log"
        argv = [*(command or [sys.executable, "-m", "kiamfast"]),
                f"--kubeconfig={fakes.api.write_kubeconfig(str(workdir / 'kubeconfig'))}",
                "--node=n1", "--host-ip=127.0.0.1",
                "--base-role-arn=arn:aws:iam::123456789012:role/",
                f"--sts-endpoint={fakes.sts.url}", f"--metadata-addr={fakes.imds.addr}",
                f"--app-port={self.port}", f"--metrics-port={metrics_port or self.port}",
                f"--table-path={workdir / 'table'}", "--cri-endpoint=none", "--iptables=false",
                f"--token-key-file={workdir / 'token-key'}", "--node-startup-taint=",
                *extra]   # later flags win: `extra` may override any of these
        base_env = dict(os.environ if env is None else env, AWS_ACCESS_KEY_ID="testing",
                        AWS_SECRET_ACCESS_KEY="testing", AWS_EC2_METADATA_DISABLED="true",
                        AWS_REGION="us-east-1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=base_env, cwd=cwd, stdout=log, stderr=log,
                                         start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "agent exited:\n" + self.log()
            try:
                if http(self.port, "GET /readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("agent never ready:\n" + self.log())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:   # kill the whole session: no orphaned workers
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return self.proc.returncode

    def children(self, module: str) -> list[int]:
        """PIDs of the supervisor's children running `python -m <module>`."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except FileNotFoundError:
                    continue
                if module.encode() in cmdline:
                    pids.append(int(pid))
        return pids


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _established_on_port(port: int) -> set[str]:
    """Inodes of the established TCP sockets whose local port is `port`."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                found.add(fields[9])   # fields[3] 01 = ESTABLISHED; fields[9] the inode
    return found


def connections_per_worker(agent: Agent, workers: list[int]) -> dict[int, int]:
    """How many established connections on the app port each worker process holds."""
    established = _established_on_port(agent.port)
    return {pid: len(_socket_inodes(pid) & established) for pid in workers}


def hold_until_spread(agent: Agent, connect, *, at_least: int = 32,
                      at_most: int = 512) -> tuple[list[socket.socket], dict[int, int]]:
    """Open connections with `connect()` (which completes a request on each, so a worker
    has accepted it) and keep them open, until there are `at_least` and every worker holds
    one, or `at_most`.  Workers race to accept on the one socket, so the split varies."""
    workers = agent.children("kiamfast.server.worker")
    held: list[socket.socket] = []
    per_worker: dict[int, int] = {}
    while len(held) < at_most:
        held.append(connect())
        if len(held) >= at_least and len(held) % 8 == 0:
            per_worker = connections_per_worker(agent, workers)
            if all(per_worker.values()):
                break
    return held, connections_per_worker(agent, workers)
