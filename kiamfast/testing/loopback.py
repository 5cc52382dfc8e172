"""One node's surroundings on loopback, and the agent itself: what the tests, the benchmarks
and ``kiamfast demo`` start when they need the whole agent without a cluster, AWS or root.

The services run in this process (threads), each on 127.0.0.1 and an ephemeral port:

* the Kubernetes API server emulator (:mod:`kiamfast.testing.apiserver`) holding the node,
  or a real API server's kubeconfig;
* moto's STS behind the recording fault proxy (:mod:`kiamfast.testing.sts`): ``sts`` is
  the proxy, which the agent calls and which counts every AssumeRole;
* the node's metadata service: the fake IMDS (:mod:`kiamfast.testing.fake_imds`), or an
  upstream the caller runs (the benchmarks' nginx);
* when asked, the node's container runtime: the CRI fault double on a unix socket
  (:mod:`kiamfast.testing.cri_fault`).

The agent runs unmodified, as the DaemonSet runs it: ``python -m kiamfast <kube2iam flags>``
(:class:`AgentProcess`), a child process tree with a log file of its own, static AWS keys
and no metadata service of the machine (:mod:`kiamfast.testing.aws_env`). Pods are API
objects whose addresses are 127.0.x.y: a client bound to one is that pod
(:mod:`kiamfast.testing.net`).

What it must never do: listen anywhere but loopback, or end a process it did not start (a
leftover of the agent's tree is killed by pid only while that pid is still the process it
saw).
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kiamfast.table import files_beside
from kiamfast.testing import procs
from kiamfast.testing.aws_env import offline_env
from kiamfast.testing.net import (ExitedEarly, free_port, http_request, one_request,
                                  split_response, wait_port)

__all__ = ["AgentProcess", "BASE_ARN", "LoopbackNode", "ROLE_KEY", "package_root", "run_each"]

BASE_ARN = "arn:aws:iam::123456789012:role/"
ROLE_KEY = "iam.amazonaws.com/role"


def package_root() -> str:
    """The directory holding the ``kiamfast`` package, so child processes run this code."""
    import kiamfast
    return str(Path(kiamfast.__file__).resolve().parent.parent)


def run_each(steps: Sequence[Callable[[], object]]) -> list[Exception]:
    """Call every step, on past one that fails (a stop must leave nothing else running);
    the errors, in order."""
    errors = []
    for step in steps:
        try:
            step()
        except Exception as e:  # noqa: BLE001 - keep stopping the rest
            errors.append(e)
    return errors


def _tmpfs() -> Path:
    """Where a node keeps the agent's table: tmpfs, as on a node, when there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class LoopbackNode:
    """The services around one node (see the module docstring). :meth:`start` starts them
    all, or each ``start_*`` one at a time; :meth:`stop` stops every part started, the
    agents it started first. ``workdir`` (default: a temporary directory, removed at stop)
    holds the kubeconfig, the runtime's socket and the agents' logs."""

    def __init__(self, *, node: str = "n1", workdir: str | os.PathLike | None = None,
                 host_ip: str = "127.0.0.1", base_role_arn: str = BASE_ARN,
                 api_token: str | None = "test-token", bookmark_interval: float = 1.0,
                 taints: list[dict] | None = None, startup_taint: str = "",
                 node_address: str | None = None,
                 kubeconfig: str | os.PathLike | None = None, sts_latency: float = 0.0,
                 imds_addr: str | None = None, runtime_name: str | None = None) -> None:
        self.node = node
        self.host_ip = host_ip
        self.base_role_arn = base_role_arn
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kiamfast-node-") if workdir is None
                            else workdir)
        self._api_options = dict(token=api_token, bookmark_interval=bookmark_interval)
        self.startup_taint = startup_taint
        if startup_taint and taints is None:     # a new node carries it until the agent is ready
            taints = [{"key": startup_taint, "effect": "NoSchedule"}]
        self._node_options = dict(taints=taints, address=node_address)
        self._real_kubeconfig = kubeconfig
        self._sts_latency = sts_latency
        self._runtime_name = runtime_name
        self.kubeconfig = Path()      # what the agent reads, once the API server is there
        self.api: Any = None          # kiamfast.testing.apiserver.ApiServer (None: a real one)
        self.sts: Any = None          # kiamfast.testing.sts.FaultProxy, in front of moto
        self.imds: Any = None         # kiamfast.testing.fake_imds.FakeImds (None: imds_addr's)
        self.imds_addr = imds_addr or ""
        self.runtime: Any = None      # kiamfast.testing.cri_fault.CriFault, when asked for
        self._sandbox: Any = None     # moto and the proxy, started and stopped together
        self.agents: list[AgentProcess] = []
        self.pods: dict[str, tuple[str, str]] = {}     # ip -> (name, role) of add_pod's pods
        self._seq = 0

    # ------------------------------------------------------------------ the services

    def start(self) -> "LoopbackNode":
        try:
            self.start_apiserver()
            if self._runtime_name is not None:
                self.start_runtime()
            self.start_sts()
            self.start_imds()
        except BaseException:
            self.stop()
            raise
        return self

    def start_apiserver(self) -> None:
        """The emulator with the node (or the real API server's kubeconfig), and the
        kubeconfig the agent reads."""
        if self._real_kubeconfig is not None:
            self.kubeconfig = Path(self._real_kubeconfig)
            return
        from kiamfast.testing.apiserver import ApiServer
        self.api = ApiServer("127.0.0.1", 0, **self._api_options).start()
        self.api.nodes.add(self.node, **self._node_options)
        self.kubeconfig = Path(self.api.write_kubeconfig(self.workdir / "kubeconfig"))

    def start_runtime(self) -> None:
        from kiamfast.testing.cri_fault import CriFault
        self.runtime = CriFault(str(self.workdir / "cri.sock"),
                                runtime_name=self._runtime_name or "cri-fault").start()

    def start_sts(self) -> None:
        from kiamfast.testing.sts import StsSandbox
        self._sandbox = StsSandbox().start()
        self.sts = self._sandbox.proxy
        self.sts.latency = self._sts_latency

    def start_imds(self) -> None:
        if self.imds_addr:
            return
        from kiamfast.testing.fake_imds import FakeImds
        self.imds = FakeImds("127.0.0.1", 0).start()
        self.imds_addr = self.imds.addr

    def stop(self) -> None:
        """Stop the agents, then every service; the first error, once all are stopped."""
        steps: list[Callable[[], object]] = [a.stop for a in self.agents]
        steps += [part.stop for part in (self.imds, self._sandbox, self.api) if part is not None]
        if self.runtime is not None:
            steps.append(self.runtime.close)
        errors = run_each(steps)
        self.agents = []
        self.imds = self._sandbox = self.sts = self.api = self.runtime = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> "LoopbackNode":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ pods and STS

    def add_pod(self, ip: str | None, role: str | None, *, namespace: str = "default",
                name: str | None = None, phase: str = "Running",
                annotations: dict[str, str] | None = None, uid: str | None = None) -> str:
        """A pod on this node at ``ip`` (None: none yet) with ``role`` in its annotation
        (None: no role); its name."""
        self._seq += 1
        name = name or f"pod-{self._seq}"
        self.api.pods.create(namespace, name, node=self.node,
                             annotations={**({ROLE_KEY: role} if role else {}),
                                          **(annotations or {})} or None,
                             ips=[ip] if ip else None, phase=phase, uid=uid)
        if ip:
            self.pods[ip] = (name, role or "")
        return name

    def access_keys(self) -> dict[str, str]:
        """AccessKeyId -> role name of every credential STS issued so far."""
        return {call.access_key_id: call.role_arn.rsplit("/", 1)[-1]
                for call in self.sts.assume_role_calls(outcome="ok") if call.access_key_id}

    def role_issued(self, access_key_id: str) -> str | None:
        """The RoleArn of the AssumeRole call whose answer carried this key, if any."""
        for call in self.sts.assume_role_calls(outcome="ok"):
            if call.access_key_id == access_key_id:
                return call.role_arn
        return None

    # ------------------------------------------------------------------ the agent

    def agent_argv(self, *, port: int, table_path: str, token_key_file: str | None = None,
                   metrics_port: int | None = None, command: Sequence[str] | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
        """The agent's command line for this node: kube2iam's flags and kiamfast's for a
        loopback node (no iptables, the node's startup taint or none, the runtime's socket
        or none), then ``extra`` (later flags win: it may override any of these).  The
        runtime double's pods are loopback addresses of this network namespace, with no
        namespace of their own for the kernel to show: READY is taken at its word
        (``--address-proof=runtime``)."""
        runtime = self.runtime.endpoint if self.runtime is not None else "none"
        proof = ["--address-proof=runtime"] if self.runtime is not None else []
        return [*(command or [sys.executable, "-m", "kiamfast"]),
                f"--kubeconfig={self.kubeconfig}", f"--node={self.node}",
                f"--host-ip={self.host_ip}", f"--base-role-arn={self.base_role_arn}",
                f"--sts-endpoint={self.sts.url}", f"--metadata-addr={self.imds_addr}",
                f"--app-port={port}", f"--metrics-port={metrics_port or port}",
                f"--table-path={table_path}",
                f"--token-key-file={token_key_file or table_path + '.key'}",
                "--iptables=false", f"--cri-endpoint={runtime}", *proof,
                f"--node-startup-taint={self.startup_taint}", *extra]

    def start_agent(self, *, port: int | None = None, metrics_port: int | None = None,
                    table_path: str | None = None, token_key_file: str | None = None,
                    log_path: str | os.PathLike | None = None, extra: Sequence[str] = (),
                    command: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                    cwd: str | os.PathLike | None = None, cpus: set[int] | None = None,
                    own_session: bool = True,
                    process: type["AgentProcess"] | None = None) -> "AgentProcess":
        """Start the agent for this node (not waited for). Without ``table_path`` its table
        is a new file on tmpfs, removed with its token key and lock once it stopped; without
        ``env``, static AWS keys and this checkout's kiamfast (``env`` is used as given);
        ``own_session``: in a process group of its own (the demo's stays in the caller's,
        so that ending the caller's group ends it too)."""
        port = port or free_port()
        files: tuple[str, ...] = ()
        if table_path is None:
            table_path = str(_tmpfs() / f"kiamfast-{self.node}-{os.getpid()}-"
                                        f"{secrets.token_hex(4)}")
            token_key_file = token_key_file or table_path + ".key"
            files = (table_path, token_key_file, *files_beside(table_path))
        argv = self.agent_argv(port=port, table_path=table_path, token_key_file=token_key_file,
                               metrics_port=metrics_port, command=command, extra=extra)
        agent = (process or AgentProcess)(
            argv, port=port, log_path=log_path or self.workdir / f"agent-{port}.log",
            table_path=table_path, files=files, cwd=cwd, cpus=cpus, own_session=own_session,
            env=dict(env) if env is not None else offline_env(PYTHONPATH=package_root()))
        self.agents.append(agent)
        return agent

    @contextlib.contextmanager
    def agent(self, **kw: Any):
        """:meth:`start_agent` for the duration of a ``with``, stopped at its end."""
        agent = self.start_agent(**kw)
        try:
            yield agent
        finally:
            agent.stop()
            self.agents.remove(agent)


class AgentProcess:
    """One start of the agent: its process tree, port and log. ``stop()`` ends it: SIGTERM,
    then SIGKILL to its process group (``own_session``) or, in the caller's group, to it and
    to every descendant seen running that is still the same process."""

    name = "kiamfast"

    def __init__(self, argv: Sequence[str], *, port: int, log_path: str | os.PathLike,
                 table_path: str = "", files: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 cpus: set[int] | None = None, own_session: bool = True) -> None:
        self.argv = list(argv)
        self.port = port
        self.table_path = table_path
        self.log_path = Path(log_path)
        self._files = tuple(files)
        self._own_session = own_session
        self._tree: dict[int, int | None] = {}      # pid -> start time, of every descendant seen
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        affinity = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        with open(self.log_path, "ab") as log:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(self.argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=own_session, preexec_fn=affinity)

    @property
    def pid(self) -> int:
        return self.proc.pid

    # ------------------------------------------------------------------ what it says

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def get(self, path: str, *, timeout: float = 1.0) -> tuple[int, bytes]:
        """GET ``path`` from 127.0.0.1 on a fresh connection: (status, body)."""
        status, _, body = split_response(one_request(self.port, http_request("GET", path),
                                                     timeout=timeout))
        return status, body

    def ready(self) -> bool:
        """Whether /readyz answers 200 now."""
        try:
            return self.get("/readyz", timeout=1.0)[0] == 200
        except (OSError, ValueError, IndexError):
            return False

    # ------------------------------------------------------------------ waiting for it

    def check(self) -> None:
        """ExitedEarly, with the log's end, if the agent has exited."""
        self._note_tree()
        if self.proc.poll() is not None:
            raise ExitedEarly(f"the agent exited with {self.proc.returncode}:\n"
                              f"{self.log_tail()}", self.proc.returncode)

    def wait_listening(self, timeout: float = 30.0) -> float:
        """Seconds from the process start until it accepted a connection."""
        wait_port(self.port, self.proc, timeout=timeout, log=self.log_tail)
        self._note_tree()
        return time.monotonic() - self.started

    def wait_ready(self, timeout: float = 60.0, *, poll: float = 0.05) -> float:
        """Seconds from the process start until /readyz answered 200."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            if self.ready():
                return time.monotonic() - self.started
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent was not ready after {timeout:g} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(poll)

    # ------------------------------------------------------------------ its processes

    def children(self, module: str) -> list[int]:
        """PIDs of the supervisor's children running ``python -m <module>``."""
        return [pid for pid in procs.children(self.pid) if module in procs.cmdline(pid)]

    def processes(self) -> dict[str, list[int]]:
        """{"supervisor": [pid], "control": [...], "worker": [...]} by command line."""
        return {"supervisor": [self.pid], "control": self.children("kiamfast.control"),
                "worker": self.children("kiamfast.server.worker")}

    def all_pids(self) -> list[int]:
        return [self.pid, *procs.children(self.pid)]

    def _note_tree(self) -> None:
        if self.proc.poll() is None:
            for pid in procs.descendants(self.pid):
                self._tree.setdefault(pid, procs.start_time(pid))

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait ``timeout``, then SIGKILL (see the class); the files it was
        given to remove. Its exit status."""
        self._note_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if self._own_session:     # the whole group: no orphaned workers
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
                self.proc.wait()
        if not self._own_session:   # children the supervisor could not stop, by pid
            for pid, started in self._tree.items():
                if started is not None and procs.start_time(pid) == started:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        for path in self._files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        return self.proc.returncode

    def __enter__(self) -> "AgentProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
