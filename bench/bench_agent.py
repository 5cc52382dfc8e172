"""A node for the benchmarks: kiamfast.testing.loopback's node (the Kubernetes API emulator,
STS as moto behind the fault proxy, the full kiamfast agent started as the DaemonSet starts
it, ``python -m kiamfast <kube2iam flags>``) with a fast metadata service (nginx) and the
benchmarks' names and flags.

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
import time

from benchutil import aws_env, child_env, free_port, python

from kiamfast.testing.loopback import BASE_ARN, ROLE_KEY, AgentProcess, LoopbackNode

__all__ = ["Agent", "BASE_ARN", "Cluster", "HOST_IP", "NODE", "ROLE_KEY",
           "UNBOUNDED_PASSTHROUGH_ARGS", "agent", "agent_argv", "agent_flags", "cluster",
           "fill_table", "full_agent_available", "role_name", "worker_only"]

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

Agent = AgentProcess


def full_agent_available() -> bool:
    """Whether ``python -m kiamfast`` can run end to end (the pod watcher exists)."""
    return importlib.util.find_spec("kiamfast.control.process") is not None


def role_name(i: int) -> str:
    return f"bench-role-{i}"


class Cluster(LoopbackNode):
    """The services around one node (see the module docstring): pods in namespace "bench";
    ``tmp``, ``imds_port`` and ``proxy`` are the node's workdir, its metadata service's port
    and STS's proxy, by the names the bench scripts use."""

    def add_pod(self, ip: str | None, role: str | None, *, namespace: str = "bench",
                phase: str = "Running", name: str | None = None,
                uid: str | None = None) -> str:
        """Create a pod on this node with ``ip`` and the role annotation; its name."""
        return super().add_pod(ip, role, namespace=namespace, phase=phase, name=name,
                               uid=uid)

    @property
    def tmp(self) -> str:
        return str(self.workdir)

    @property
    def imds_port(self) -> int:
        return int(self.imds_addr.rsplit(":", 1)[1])

    @property
    def proxy(self):
        return self.sts


@contextlib.contextmanager
def cluster(*, sts_latency: float = 0.0, bookmark_interval: float = 5.0):
    """Emulator + moto STS behind the fault proxy + nginx as the metadata service."""
    from bench_servers import nginx

    with aws_env(), \
            nginx(b"not served: the imds upstream only answers token and instance-id\n") \
            as imds, Cluster(node=NODE, host_ip=HOST_IP, api_token="bench-token",
                             bookmark_interval=bookmark_interval, sts_latency=sts_latency,
                             imds_addr=f"127.0.0.1:{imds.port}") as c:
        yield c


def agent_flags(*, workers: int = 1, sts_qps: float | None = None,
                sts_burst: int | None = None) -> list[str]:
    """What the benchmarks add to a loopback node's flags: loopback only, quiet, unbounded
    passthrough, the STS rate limit when given."""
    return ["--sts-region=us-east-1", "--listen-host=127.0.0.1", "--log-level=warn",
            f"--workers={workers}", *UNBOUNDED_PASSTHROUGH_ARGS,
            *([f"--sts-qps={sts_qps}"] if sts_qps is not None else []),
            *([f"--sts-burst={sts_burst}"] if sts_burst is not None else [])]


def agent_argv(c: LoopbackNode, *, port: int, table_path: str, workers: int = 1,
               sts_qps: float | None = None, sts_burst: int | None = None,
               extra: list[str] | None = None) -> list[str]:
    return c.agent_argv(port=port, table_path=table_path, extra=[
        *agent_flags(workers=workers, sts_qps=sts_qps, sts_burst=sts_burst), *(extra or ())])


@contextlib.contextmanager
def agent(c: LoopbackNode, *, workers: int = 1, sts_qps: float | None = None,
          sts_burst: int | None = None, extra: list[str] | None = None,
          cpus: set[int] | None = None):
    """The agent for ``c``'s node; yields an :class:`Agent` (not yet ready), stopped and its
    table removed at the end."""
    with c.agent(extra=[*agent_flags(workers=workers, sts_qps=sts_qps, sts_burst=sts_burst),
                        *(extra or ())], env=child_env(), cpus=cpus) as a:
        yield a


def fill_table(table_path: str, ips: list[str], *, roles: int) -> dict[str, str]:
    """A table at ``table_path`` holding what the control process would render: ``roles``
    roles' credentials, pod ``i`` at ``ips[i]`` with role ``i % roles``, ready. The access
    key of each role -> its name."""
    from kiamfast import table as tbl
    from kiamfast import credential_parts

    t = tbl.Table.create(table_path, ip_capacity=4096, cred_capacity=256, value_size=16384,
                         aux_count=4, aux_size=1 << 16, max_workers=8)
    now = time.time()
    keys = {}
    for r in range(roles):
        key = f"ASIABENCH{r:011d}"
        keys[key] = role_name(r)
        t.write_cred(r, credential_parts.render_credentials(
            role_arn=BASE_ARN + role_name(r), access_key_id=key, secret_access_key="s" * 40,
            session_token="FwoGZXIvYXdzE" + "x" * 600, expiration=now + 3600,
            last_updated=now, base_role_arn=BASE_ARN), serve_until=now + 2700)
    for i, ip in enumerate(ips):
        t.claim_ip(ip, f"pod-{i}", tbl.POD_ROLE, i % roles)
    t.set_status(synced=True, ready=True)
    t.close()
    return keys


@contextlib.contextmanager
def worker_only(ips: list[str], *, roles: int, imds_port: int,
                cpus: set[int] | None = None):
    """One server worker over a table this function fills (:func:`fill_table`), so the hot
    path can be measured without the supervisor and the control process. Yields an
    :class:`Agent` whose ``processes()["worker"]`` is the worker; ``keys`` maps access keys
    to roles."""
    from kiamfast.server.settings import WorkerSettings

    port = free_port()
    table_path = f"/dev/shm/kiamfast-bench-{os.getpid()}-{secrets.token_hex(4)}"
    keys = fill_table(table_path, ips, roles=roles)
    settings = WorkerSettings(app_port=port, listen_host="127.0.0.1",
                              metadata_addr=f"127.0.0.1:{imds_port}",
                              token_key=secrets.token_bytes(32),
                              passthrough_rate=UNBOUNDED, passthrough_burst=UNBOUNDED,
                              passthrough_concurrency=UNBOUNDED)
    a = _WorkerOnly([python(), "-m", "kiamfast.server.worker", "--table", table_path,
                     "--settings-json", settings.to_json(), "--log-level", "warning"],
                    port=port, log_path=table_path + ".log", table_path=table_path,
                    files=(table_path, table_path + ".log"), env=child_env(), cpus=cpus)
    a.keys = keys
    try:
        a.wait_listening()
        yield a
    finally:
        a.stop(10)


class _WorkerOnly(Agent):
    keys: dict[str, str]

    def processes(self) -> dict[str, list[int]]:
        return {"supervisor": [], "control": [], "worker": [self.pid]}

    def all_pids(self) -> list[int]:
        return [self.pid]
