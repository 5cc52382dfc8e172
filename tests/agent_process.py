"""The real agent (`kiamfast`: supervisor, workers, control) on a loopback node
(kiamfast.testing.loopback): the API server emulator with node n1 and one pod with a role,
moto's STS behind the recording proxy, the fake IMDS; pods are loopback source addresses.
Used wherever a test needs the whole agent: tests/agent, tests/supervisor,
tests/deploy/test_dashboard.py, tests/server/test_token_key_file.py, tests/kube2iam,
tests/podidentity.
"""

from __future__ import annotations

import socket
from pathlib import Path

from kiamfast.testing.aws_env import offline_env
from kiamfast.testing.loopback import ROLE_KEY, AgentProcess, LoopbackNode
from kiamfast.testing.net import free_port, http_request, one_request

POD_IP = "127.0.0.5"
ROLE = "app-role"
LISTING = "/latest/meta-data/iam/security-credentials/"


def exchange(port: int, method: str, path: str, *, source: str = "127.0.0.1",
             headers: dict[str, str] | None = None, timeout: float = 5.0) -> bytes:
    """One request on a fresh connection from ``source``; the raw response."""
    return one_request(port, http_request(method, path, headers=headers), source=source,
                       timeout=timeout)


def http(port: int, request: str, *, source: str = "127.0.0.1",
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request ("GET /path" or "PUT /path") on a fresh connection; (status, body)."""
    method, path = request.split(" ", 1)
    head, _, body = exchange(port, method, path, source=source,
                             headers=headers).partition(b"\r\n\r\n")
    return int(head.split()[1]), body


class Fakes(LoopbackNode):
    """The loopback node, started: node n1 (with ``taints``), pod team/app with ROLE at
    POD_IP."""

    def __init__(self, *, taints: list[dict] | None = None) -> None:
        super().__init__(taints=taints)
        self.start()
        self.api.pods.create("team", "app", node=self.node, annotations={ROLE_KEY: ROLE},
                             ips=[POD_IP], phase="Running")


class Agent(AgentProcess):
    """One start of the agent for ``node`` with its table, token key and log in ``workdir``
    (a start in the same workdir adopts them); `wait_ready` until /readyz says 200, `stop`
    with SIGTERM. ``env``: the base of its environment (default this process's), to which
    static AWS keys are added."""

    def __init__(self, node: LoopbackNode, workdir: Path, *, command: list[str] | None = None,
                 cwd: str | None = None, extra: list[str] = (), port: int | None = None,
                 metrics_port: int | None = None, env: dict[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        table = str(workdir / "table")
        super().__init__(node.agent_argv(port=port, metrics_port=metrics_port, table_path=table,
                                         token_key_file=str(workdir / "token-key"),
                                         command=command, extra=extra),
                         port=port, log_path=workdir / "agent.log", table_path=table,
                         cwd=cwd, env=offline_env(base=env))


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
