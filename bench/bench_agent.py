"""A node for the benchmarks: the Kubernetes API emulator, STS (moto behind the fault proxy),
a fast fake metadata service (nginx), and the full kiamfast agent started as the DaemonSet
starts it, ``python -m kiamfast <kube2iam flags>``.

Everything listens on loopback. Pods are objects in the emulator whose IPs are 127.0.x.y
addresses, so a client socket bound to a pod's IP *is* that pod as far as the agent can
tell (it identifies callers by the TCP source address), with no root and no namespaces.

The cluster services run in the benchmark process (threads): benchmarks drive them directly
(create and delete pods, add STS latency, count AssumeRole calls and which access key was
issued for which role). The agent is a child process tree (supervisor, control process,
workers); it is stopped through its own Popen, and its shared-memory table file removed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from benchutil import (aws_env, child_env, children, cmdline, free_port, python, stop,
                       wait_port)

ACCOUNT = "123456789012"
BASE_ARN = f"arn:aws:iam::{ACCOUNT}:role/"
ROLE_KEY = "iam.amazonaws.com/role"
NODE = "node-bench"
# The node's own address: the agent never gives it pod credentials, so it must be none of the
# pods' (127.0.0.1 is a pod too: wrk's only source address).
HOST_IP = "127.0.0.2"


# The load benchmarks measure the passthrough's speed from a few addresses, not the per-pod
# bound (--passthrough-qps/-burst/-concurrency) that keeps one pod from flooding it.
UNBOUNDED = 1 << 30
UNBOUNDED_PASSTHROUGH_ARGS = (f"--passthrough-qps={UNBOUNDED}",
                              f"--passthrough-burst={UNBOUNDED}",
                              f"--passthrough-concurrency={UNBOUNDED}")


def full_agent_available() -> bool:
    """Whether ``python -m kiamfast`` can run end to end (the pod watcher exists)."""
    return importlib.util.find_spec("kiamfast.control.process") is not None


def role_name(i: int) -> str:
    return f"bench-role-{i}"


@dataclass
class Cluster:
    """The services around one node (see the module docstring)."""
    api: object                 # kiamfast.testing.apiserver.ApiServer
    proxy: object               # kiamfast.testing.sts.FaultProxy
    imds_port: int
    kubeconfig: str
    tmp: str
    node: str = NODE
    pods: dict[str, tuple[str, str]] = field(default_factory=dict)  # ip -> (name, role)
    _seq: int = 0

    def add_pod(self, ip: str, role: str | None, *, namespace: str = "bench",
                phase: str = "Running", name: str | None = None,
                uid: str | None = None) -> str:
        """Create a pod on this node with ``ip`` and the role annotation; its name."""
        self._seq += 1
        name = name or f"pod-{self._seq}"
        self.api.create_pod(namespace, name, node=self.node,
                            annotations={ROLE_KEY: role} if role else None,
                            ips=[ip] if ip else None, phase=phase, uid=uid)
        if ip:
            self.pods[ip] = (name, role or "")
        return name

    def access_keys(self) -> dict[str, str]:
        """AccessKeyId -> role name of every credential STS issued so far."""
        out = {}
        for call in self.proxy.assume_role_calls(outcome="ok"):
            if call.access_key_id:
                out[call.access_key_id] = call.role_arn.rsplit("/", 1)[-1]
        return out


@contextlib.contextmanager
def cluster(*, sts_latency: float = 0.0, bookmark_interval: float = 5.0):
    """Emulator + moto STS behind the fault proxy + nginx as the metadata service."""
    import logging

    from bench_servers import nginx
    from kiamfast.testing.apiserver import ApiServer
    from kiamfast.testing.sts import FaultProxy, MotoSts

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with aws_env(), tempfile.TemporaryDirectory(prefix="kiamfast-bench-node-") as tmp, \
            MotoSts() as moto, FaultProxy(moto.url, latency=sts_latency) as proxy, \
            nginx(b"not served: the imds upstream only answers token and instance-id\n") \
            as imds, ApiServer(token="bench-token",
                               bookmark_interval=bookmark_interval) as api:
        api.add_node(NODE)
        kubeconfig = api.write_kubeconfig(os.path.join(tmp, "kubeconfig"))
        yield Cluster(api=api, proxy=proxy, imds_port=imds.port, kubeconfig=kubeconfig,
                      tmp=tmp)


@dataclass
class Agent:
    proc: subprocess.Popen
    port: int
    table_path: str
    started: float               # time.monotonic() just before Popen
    log_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def processes(self) -> dict[str, list[int]]:
        """{"supervisor": [pid], "control": [...], "worker": [...]} by command line."""
        out: dict[str, list[int]] = {"supervisor": [self.pid], "control": [], "worker": []}
        for pid in children(self.pid):
            args = cmdline(pid)
            if "kiamfast.server.worker" in args:
                out["worker"].append(pid)
            elif "kiamfast.control" in args:
                out["control"].append(pid)
        return out

    def all_pids(self) -> list[int]:
        return [self.pid, *children(self.pid)]

    def get(self, path: str, *, timeout: float = 1.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def ready(self) -> bool:
        try:
            return self.get("/readyz", timeout=0.5)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 60.0, *, poll: float = 0.005) -> float:
        """Seconds from process start until /readyz answered 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if self.ready():
                return time.monotonic() - self.started
            time.sleep(poll)
        raise RuntimeError(f"agent not ready after {timeout} s: {self.log_tail()}")

    def wait_listening(self, timeout: float = 30.0) -> float:
        wait_port(self.port, self.proc, timeout=timeout)
        return time.monotonic() - self.started

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""


def agent_argv(c: Cluster, *, port: int, table_path: str, workers: int = 1,
               sts_qps: float | None = None, sts_burst: int | None = None,
               extra: list[str] | None = None) -> list[str]:
    argv = [python(), "-m", "kiamfast",
            "--kubeconfig", c.kubeconfig, "--node", c.node, "--host-ip", HOST_IP,
            "--base-role-arn", BASE_ARN, "--sts-endpoint", c.proxy.url,
            "--sts-region", "us-east-1", "--table-path", table_path,
            "--token-key-file", table_path + ".key",
            "--listen-host", "127.0.0.1", f"--app-port={port}", f"--metrics-port={port}",
            "--metadata-addr", f"127.0.0.1:{c.imds_port}", "--iptables=false",
            "--node-startup-taint=", "--cri-endpoint=none",
            "--log-level", "warn", f"--workers={workers}",
            *UNBOUNDED_PASSTHROUGH_ARGS]
    if sts_qps is not None:
        argv.append(f"--sts-qps={sts_qps}")
    if sts_burst is not None:
        argv.append(f"--sts-burst={sts_burst}")
    return argv + list(extra or ())


@contextlib.contextmanager
def agent(c: Cluster, *, workers: int = 1, sts_qps: float | None = None,
          sts_burst: int | None = None, extra: list[str] | None = None,
          cpus: set[int] | None = None):
    """The agent for ``c``'s node; yields an :class:`Agent` (not yet ready)."""
    port = free_port()
    table_path = f"/dev/shm/kiamfast-bench-{os.getpid()}-{secrets.token_hex(4)}"
    log_path = os.path.join(c.tmp, f"agent-{port}.log")
    argv = agent_argv(c, port=port, table_path=table_path, workers=workers, sts_qps=sts_qps,
                      sts_burst=sts_burst, extra=extra)
    log = open(log_path, "wb")
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=preexec)
    try:
        yield Agent(proc=proc, port=port, table_path=table_path, started=started,
                    log_path=log_path)
    finally:
        stop(proc, timeout=15)
        log.close()
        for path in (table_path, table_path + ".key", table_path + ".lock"):
            with contextlib.suppress(OSError):
                os.unlink(path)


@contextlib.contextmanager
def worker_only(ips: list[str], *, roles: int, imds_port: int,
                cpus: set[int] | None = None):
    """Fallback while ``python -m kiamfast`` cannot run end to end: one server worker over a
    table this function fills (the credentials the control process would render), so the
    hot path can be measured without the control process. Yields an :class:`Agent`-like
    object whose ``processes()["worker"]`` is the worker; ``access_keys`` maps keys to roles.
    """
    from kiamfast import table as tbl
    from kiamfast.control.iam import render
    from kiamfast.server.settings import WorkerSettings

    port = free_port()
    table_path = f"/dev/shm/kiamfast-bench-{os.getpid()}-{secrets.token_hex(4)}"
    t = tbl.Table.create(table_path, ip_capacity=4096, cred_capacity=256, value_size=16384,
                         aux_count=4, aux_size=1 << 16, max_workers=8)
    now = time.time()
    keys = {}
    for r in range(roles):
        key = f"ASIABENCH{r:011d}"
        keys[key] = role_name(r)
        t.write_cred(r, render.render_credentials(
            role_arn=BASE_ARN + role_name(r), access_key_id=key, secret_access_key="s" * 40,
            session_token="FwoGZXIvYXdzE" + "x" * 600, expiration=now + 3600,
            last_updated=now, base_role_arn=BASE_ARN), serve_until=now + 2700)
    for i, ip in enumerate(ips):
        t.claim_ip(ip, f"pod-{i}", tbl.POD_ROLE, i % roles)
    t.set_status(synced=True, ready=True)
    t.close()
    settings = WorkerSettings(app_port=port, listen_host="127.0.0.1",
                              metadata_addr=f"127.0.0.1:{imds_port}",
                              token_key=secrets.token_bytes(32),
                              passthrough_rate=UNBOUNDED, passthrough_burst=UNBOUNDED,
                              passthrough_concurrency=UNBOUNDED)
    log_path = table_path + ".log"
    log = open(log_path, "wb")
    preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    started = time.monotonic()
    proc = subprocess.Popen([python(), "-m", "kiamfast.server.worker", "--table", table_path,
                             "--settings-json", settings.to_json(), "--log-level", "warning"],
                            env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=preexec)
    a = _WorkerOnly(proc=proc, port=port, table_path=table_path, started=started,
                    log_path=log_path)
    a.keys = keys
    try:
        a.wait_listening()
        yield a
    finally:
        stop(proc)
        log.close()
        for path in (table_path, log_path):
            with contextlib.suppress(OSError):
                os.unlink(path)


class _WorkerOnly(Agent):
    keys: dict[str, str]

    def processes(self) -> dict[str, list[int]]:
        return {"supervisor": [], "control": [], "worker": [self.pid]}

    def all_pids(self) -> list[int]:
        return [self.pid]
