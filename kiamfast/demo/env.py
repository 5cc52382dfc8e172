"""The demo's world on loopback: API server, container runtime, STS, metadata service, the
agent, pods.

Why it exists: ``kiamfast demo`` must run on a bare laptop (no cluster, no AWS, no root), so
everything a node has is started here, on 127.0.0.1 and ephemeral ports:

* the Kubernetes API server emulator (:mod:`kiamfast.testing.apiserver`), in this process;
* the node's container runtime: the CRI fault double speaking the real CRI v1 gRPC protocol
  on a unix socket (:mod:`kiamfast.testing.cri_fault`), in this process; every pod the
  demo starts gets a READY sandbox there, as the kubelet would create one;
* moto's STS behind the recording proxy (:mod:`kiamfast.testing.sts`), in this process;
* a fake EC2 metadata service standing for the node's real one
  (:mod:`kiamfast.testing.fake_imds`), in this process;
* the agent itself, unmodified: ``python -m kiamfast <kube2iam flags>`` as a child process
  tree, with its own log file;
* the pods: one short-lived process each (:mod:`kiamfast.demo.pod`), a real botocore
  client whose connections leave from the pod's 127/8 address.

What it must never do: send anything off loopback (every URL handed out is 127.0.0.1, the
agent gets static fake keys and ``AWS_EC2_METADATA_DISABLED=true``, pods get the agent as
their metadata endpoint), leave a process or a file behind after :meth:`close`, or end a
process it did not start.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kiamfast.demo import scenario

__all__ = ["AgentDied", "DemoEnvironment", "DemoError", "MissingExtra", "PodProcess",
           "check_extra"]

REGION = "us-east-1"
POD_TIMEOUT = 20.0
#: Environment variables that would send a client anywhere but where the demo points it.
_DROP_ENV_PREFIXES = ("AWS_", "BOTO_", "KUBECONFIG")
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
               "all_proxy")


class DemoError(Exception):
    """The demo could not set its world up (a component did not start, timed out...)."""


class MissingExtra(DemoError):
    """The demo's dependencies (the ``demo`` extra) are not installed."""


class AgentDied(DemoError):
    """The agent process exited while the demo needed it."""


def check_extra() -> None:
    """Raise :class:`MissingExtra` unless moto's server and the CRI fault double (grpcio and
    the generated CRI stubs) can be imported."""
    import importlib.util

    missing = [m for m in ("moto", "flask", "boto3", "grpc", "cri_api")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(f"the demo needs {', '.join(missing)}: "
                           f"pip install -e '.[demo]'  (or: pip install 'kiamfast[demo]')")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROP_ENV_PREFIXES) and k not in _PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    env.update(extra)
    return env


def _package_root() -> str:
    """The directory holding the ``kiamfast`` package, so child processes run this code."""
    import kiamfast
    return str(Path(kiamfast.__file__).resolve().parent.parent)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc), children first-found order."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def _start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (with the pid, a process' identity), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its ")".
    return int(stat.rsplit(b")", 1)[1].split()[19])


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


class DemoEnvironment:
    """Starts the demo's components one by one; :meth:`close` stops all of them."""

    def __init__(self, *, workers: int = 1) -> None:
        self.workers = workers
        self.workdir = Path(tempfile.mkdtemp(prefix="kiamfast-demo-"))
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.workdir
        self.table_path = str(base / f"kiamfast-demo-{os.getpid()}-{secrets.token_hex(4)}")
        self.agent_log = self.workdir / "agent.log"
        self.api: Any = None
        self.sts: Any = None
        self.imds: Any = None
        self.agent: subprocess.Popen | None = None
        self.agent_port = 0
        self.runtime: Any = None
        self._sandboxes: dict[str, str] = {}   # pod ref -> sandbox id
        self.kubeconfig = ""
        self._agent_tree: dict[int, int | None] = {}  # pid -> start time
        self._table: Any = None
        self._log_file: Any = None
        self._pods: list[PodProcess] = []

    # ------------------------------------------------------------------ components

    def start_apiserver(self) -> None:
        from kiamfast.testing.apiserver import ApiServer

        # No token: the emulator speaks plain HTTP, and kubectl (client-go) sends a user's
        # credentials only over TLS, so with one the printed kubectl line would get 401.  It
        # listens on loopback, for the demo's life, and holds only the demo's pods.
        self.api = ApiServer("127.0.0.1", 0, token=None).start()
        self.api.add_node(scenario.NODE, address="127.0.0.1", taints=[
            {"key": scenario.STARTUP_TAINT, "effect": "NoSchedule"}])
        self.kubeconfig = self.api.write_kubeconfig(self.workdir / "kubeconfig")

    def start_runtime(self) -> None:
        from kiamfast.testing.cri_fault import CriFault

        self.runtime = CriFault(os.path.join(self.workdir, "cri.sock"),
                                runtime_name="demo-runtime").start()

    def run_sandbox(self, pod: Any, uid: str) -> None:
        """The kubelet's RunPodSandbox for ``pod``: CNI gives it its address at once."""
        from kiamfast.testing.cri_fault import fake_sandbox

        sandbox = fake_sandbox(name=pod.name, namespace=pod.namespace, uid=uid, ip=pod.ip,
                               annotations=pod.annotations)
        self.runtime.put(sandbox)
        self._sandboxes[pod.ref] = sandbox.id

    def stop_sandbox(self, pod: Any) -> None:
        """StopPodSandbox: the pod's containers are gone and its address is free."""
        self.runtime.stop_sandbox(self._sandboxes.pop(pod.ref))

    def start_sts(self) -> None:
        # moto's werkzeug server logs every request on stderr unless told otherwise.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        from kiamfast.testing.sts import StsSandbox

        self.sts = StsSandbox().start()

    def start_imds(self) -> None:
        from kiamfast.testing.fake_imds import FakeImds

        self.imds = FakeImds("127.0.0.1", 0).start()

    @property
    def sts_url(self) -> str:
        return self.sts.endpoint_url

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}/"

    def agent_argv(self) -> list[str]:
        """The agent's command line: kube2iam's flags, plus kiamfast's for the loopback world."""
        return [
            sys.executable, "-m", "kiamfast",
            f"--kubeconfig={self.kubeconfig}",
            f"--node={scenario.NODE}",
            "--host-ip=127.0.0.1",
            f"--base-role-arn={scenario.BASE_ROLE_ARN}",
            f"--default-role={scenario.DEFAULT_ROLE}",
            "--namespace-restrictions",
            f"--app-port={self.agent_port}",
            f"--metrics-port={self.agent_port}",
            f"--metadata-addr={self.imds.addr}",
            "--iptables=false",
            f"--sts-endpoint={self.sts_url}",
            f"--sts-region={REGION}",
            f"--cri-endpoint={self.runtime.endpoint}",
            f"--table-path={self.table_path}",
            f"--token-key-file={self.workdir / 'token-key'}",
            "--listen-host=127.0.0.1",
            f"--node-startup-taint={scenario.STARTUP_TAINT}",
            f"--workers={self.workers}",
        ]

    def start_agent(self, *, timeout: float = 20.0) -> None:
        """Start the agent and return once it accepts connections."""
        self.agent_port = free_port()
        env = _clean_env({
            # The agent's own identity for STS, as the node's instance profile would be.
            "AWS_ACCESS_KEY_ID": "AKIADEMONODEEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": "demo-node-secret",
            "AWS_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "PYTHONPATH": _package_root(),
        })
        self._log_file = open(self.agent_log, "wb")
        self.agent = subprocess.Popen(self.agent_argv(), stdin=subprocess.DEVNULL,
                                      stdout=self._log_file, stderr=subprocess.STDOUT,
                                      env=env, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while True:
            self._note_agent_tree()
            self.check_agent()
            try:
                socket.create_connection(("127.0.0.1", self.agent_port), timeout=0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise DemoError(f"the agent did not listen on port {self.agent_port} "
                                    f"within {timeout:.0f} s") from None
                time.sleep(0.02)

    def check_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is not None:
            raise AgentDied(f"the agent exited with status {self.agent.returncode}")

    def _note_agent_tree(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            for pid in _descendants(self.agent.pid):
                if pid not in self._agent_tree:
                    self._agent_tree[pid] = _start_time(pid)

    def agent_get(self, path: str, *, timeout: float = 2.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.agent_port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def node_tainted(self) -> bool:
        taints = (self.api.get_node(scenario.NODE).get("spec") or {}).get("taints") or []
        return any(t.get("key") == scenario.STARTUP_TAINT for t in taints)

    def wait_ready(self, *, timeout: float = 30.0) -> float:
        """Wait for ``/readyz`` = 200 and the startup taint gone; returns seconds waited."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            self._note_agent_tree()
            self.check_agent()
            try:
                ready = self.agent_get("/readyz", timeout=1.0)[0] == 200
            except OSError:
                ready = False
            if ready and not self.node_tainted():
                return time.monotonic() - started
            if time.monotonic() > deadline:
                what = "did not report ready" if not ready else "did not remove the node's " \
                                                                  "startup taint"
                raise DemoError(f"the agent {what} within {timeout:.0f} s")
            time.sleep(0.02)

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

    # ------------------------------------------------------------------ pods

    def pod_argv(self, ip: str) -> list[str]:
        return [sys.executable, "-m", "kiamfast.demo.pod", "--ip", ip,
                "--imds", self.agent_url, "--sts-endpoint", self.sts_url]

    def spawn_pod(self, ip: str) -> "PodProcess":
        """Start a pod client from ``ip``, ready to make its first call on :meth:`go`."""
        home = self.workdir / "home"
        home.mkdir(exist_ok=True)
        env = _clean_env({
            "HOME": str(home),
            "PYTHONPATH": _package_root(),
            "AWS_EC2_METADATA_SERVICE_ENDPOINT": self.agent_url,
        })
        pod = PodProcess(ip, self.pod_argv(ip) + ["--wait-for-go"], env=env, cwd=home)
        self._pods.append(pod)
        return pod

    def run_pod(self, ip: str) -> dict:
        """Run one pod client from ``ip``; returns its report (``crashed`` if it had none)."""
        pod = self.spawn_pod(ip)
        pod.wait_ready()
        return pod.go()

    def run_pods(self, ips: list[str]) -> list[dict]:
        """Start the pod clients together, then let each make its call in turn: start-up
        is paid in parallel, and no call's latency includes another process' CPU work."""
        pods = [self.spawn_pod(ip) for ip in ips]
        for pod in pods:
            pod.wait_ready()
        return [pod.go() for pod in pods]

    # ------------------------------------------------------------------ what STS and IMDS saw

    def assume_role_calls(self) -> list:
        return self.sts.proxy.assume_role_calls() if self.sts else []

    def node_secret_requests(self) -> list[str]:
        """Paths of requests for the node's secrets that reached its metadata service."""
        if self.imds is None:
            return []
        bad = ("/iam/", "identity-credentials", "user-data")
        return [r.path for r in self.imds.requests
                if any(b in r.path.split("?", 1)[0] + "/" for b in bad)]

    def agent_log_tail(self, lines: int = 15) -> list[str]:
        try:
            text = self.agent_log.read_text(errors="replace")
        except OSError:
            return []
        return text.strip().splitlines()[-lines:]

    # ------------------------------------------------------------------ shutdown

    def stop_pods(self) -> None:
        for pod in self._pods:
            pod.kill()
        self._pods.clear()

    def stop_agent(self) -> None:
        proc = self.agent
        if proc is None:
            return
        self._note_agent_tree()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=12)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Children a supervisor could not stop: end them by pid, only if that pid is still
        # the same process (same start time), never a newcomer that reused the number.
        for pid, started in self._agent_tree.items():
            if started is not None and _start_time(pid) == started:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        self.agent = None

    def close(self, *, keep_workdir: bool = False) -> None:
        errors: list[BaseException] = []
        steps = [self.stop_pods, self.stop_agent]
        if self._table is not None:
            steps.append(self._table.close)
        for part in (self.imds, self.sts, self.api):
            if part is not None:
                steps.append(part.stop)
        if self.runtime is not None:
            steps.append(self.runtime.close)
        for step in steps:
            try:
                step()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                errors.append(e)
        self.imds = self.sts = self.api = self._table = self.runtime = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        for path in (self.table_path, self.table_path + ".token-key", self.table_path + ".lock"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise DemoError(f"while stopping: {errors[0]!r}")
