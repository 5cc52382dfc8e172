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

The services and the agent are a :class:`kiamfast.testing.loopback.LoopbackNode`, the one the
tests and benchmarks run; the demo adds its scenario's flags, the pods and the checks.

What it must never do: send anything off loopback (every URL handed out is 127.0.0.1, the
agent gets static fake keys and ``AWS_EC2_METADATA_DISABLED=true``, pods get the agent as
their metadata endpoint), leave a process or a file behind after :meth:`close`, or end a
process it did not start.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kiamfast.demo import scenario
from kiamfast.testing.aws_env import offline_env
from kiamfast.testing.loopback import AgentProcess, package_root, run_each
from kiamfast.testing.net import ExitedEarly, free_port

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


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_DROP_ENV_PREFIXES) and k not in _PROXY_VARS}
    env["NO_PROXY"] = env["no_proxy"] = "*"
    env.update(extra)
    return env


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
        from kiamfast.testing.loopback import LoopbackNode

        self.workers = workers
        self.workdir = Path(tempfile.mkdtemp(prefix="kiamfast-demo-"))
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else self.workdir
        self.table_path = str(base / f"kiamfast-demo-{os.getpid()}-{secrets.token_hex(4)}")
        self.agent_log = self.workdir / "agent.log"
        self.node = LoopbackNode(
            node=scenario.NODE, workdir=self.workdir, host_ip="127.0.0.1",
            # No token: the emulator speaks plain HTTP, and kubectl (client-go) sends a
            # user's credentials only over TLS, so with one the printed kubectl line would
            # get 401.  It listens on loopback, for the demo's life, with the demo's pods.
            base_role_arn=scenario.BASE_ROLE_ARN, api_token=None,
            startup_taint=scenario.STARTUP_TAINT, node_address="127.0.0.1",
            runtime_name="demo-runtime")
        self.agent: AgentProcess | None = None
        self.agent_port = 0
        self._sandboxes: dict[str, str] = {}   # pod ref -> sandbox id
        self._table: Any = None
        self._pods: list[PodProcess] = []

    # ------------------------------------------------------------------ components

    @property
    def api(self) -> Any:
        return self.node.api

    @property
    def imds(self) -> Any:
        return self.node.imds

    @property
    def runtime(self) -> Any:
        return self.node.runtime

    @property
    def kubeconfig(self) -> str:
        return str(self.node.kubeconfig)

    def start_apiserver(self) -> None:
        self.node.start_apiserver()

    def start_runtime(self) -> None:
        self.node.start_runtime()

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
        self.node.start_sts()

    def start_imds(self) -> None:
        self.node.start_imds()

    @property
    def sts_url(self) -> str:
        return self.node.sts.url

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_port}/"

    def agent_argv(self) -> list[str]:
        """The agent's command line: kube2iam's flags, plus kiamfast's for the loopback world."""
        return self.node.agent_argv(
            port=self.agent_port, table_path=self.table_path,
            token_key_file=str(self.workdir / "token-key"), extra=[
                f"--default-role={scenario.DEFAULT_ROLE}", "--namespace-restrictions",
                f"--sts-region={REGION}", "--listen-host=127.0.0.1",
                f"--workers={self.workers}"])

    def start_agent(self, *, timeout: float = 20.0) -> None:
        """Start the agent and return once it accepts connections."""
        self.agent_port = free_port()
        # The agent's own identity for STS, as the node's instance profile would be.
        env = offline_env(_clean_env({}), AWS_ACCESS_KEY_ID="AKIADEMONODEEXAMPLE",
                          AWS_SECRET_ACCESS_KEY="demo-node-secret", AWS_REGION=REGION,
                          PYTHONPATH=package_root())
        # In this process's group: a run that hangs is ended with everything it started.
        self.agent = AgentProcess(self.agent_argv(), port=self.agent_port,
                                  log_path=self.agent_log, table_path=self.table_path,
                                  env=env, cwd=self.workdir, own_session=False)
        try:
            self.agent.wait_listening(timeout)
        except ExitedEarly as e:
            raise AgentDied(f"the agent exited with status {e.returncode}") from None
        except RuntimeError:
            raise DemoError(f"the agent did not listen on port {self.agent_port} "
                            f"within {timeout:.0f} s") from None

    def check_agent(self) -> None:
        if self.agent is not None:
            try:
                self.agent.check()
            except ExitedEarly as e:
                raise AgentDied(f"the agent exited with status {e.returncode}") from None

    def agent_get(self, path: str, *, timeout: float = 2.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.agent_port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def node_tainted(self) -> bool:
        taints = (self.api.nodes.get(scenario.NODE).get("spec") or {}).get("taints") or []
        return any(t.get("key") == scenario.STARTUP_TAINT for t in taints)

    def wait_ready(self, *, timeout: float = 30.0) -> float:
        """Wait for ``/readyz`` = 200 and the startup taint gone; returns seconds waited."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
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
            "PYTHONPATH": package_root(),
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
        return self.node.sts.assume_role_calls() if self.node.sts else []

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
        if self.agent is not None:
            self.agent.stop(12)
            self.agent = None

    def close(self, *, keep_workdir: bool = False) -> None:
        from kiamfast import table

        steps = [self.stop_pods, self.stop_agent]
        if self._table is not None:
            steps.append(self._table.close)
        errors = run_each([*steps, self.node.stop])
        self._table = None
        for path in (self.table_path, self.table_path + ".token-key",
                     *table.files_beside(self.table_path)):
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise DemoError(f"while stopping: {errors[0]!r}")
