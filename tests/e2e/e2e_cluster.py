"""One Kubernetes node for end-to-end tests: its network, the services around it, the agent.

:class:`Node` puts together everything a kiamfast agent meets on a real node, each inside the
node's network namespace (see :mod:`netns`), so no byte of the test traffic leaves the
namespaces the test created:

* the **fake instance-metadata service** (:mod:`kiamfast.testing.fake_imds`) on
  ``169.254.169.254:80``. It hands out the *node's* role; its AccessKeyId starts with
  ``ASIANODE``, so any answer a pod gets can be checked for a leak. It records every request,
  so a test can also show that no pod's credential request ever reached it;
* the **Kubernetes API server emulator** (:mod:`kiamfast.testing.apiserver`) on the node's
  loopback, with this node registered (by default with the startup taint);
* **STS**: moto on the node's host IP (pods reach it to ask "who am I?" with the credentials
  they got) behind the fault-injecting proxy of :mod:`kiamfast.testing.sts` on the node's
  loopback, which is the agent's ``--sts-endpoint`` and records which access key STS issued
  for which role;
* the **agent** (:class:`Agent`), started exactly as the DaemonSet starts it: ``python -m
  kiamfast`` with kube2iam-style flags, inside the node namespace;
* **pods** (:class:`Pod`): a network namespace with the pod's IP plus the pod object in the
  emulator, and ways to run real SDKs inside it.

The services run in the test process (threads placed in the node namespace), so tests drive
them directly: create pods, make the API server late with their status, add STS faults.
:mod:`runtime_node` extends this node with a real containerd whose sandboxes are the pods.
Everything is torn down by :meth:`Node.close`, also after a failure: the agent and its
children are stopped by pid, the namespaces deleted, the shared-memory files removed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from imds_probe import Prober, Sample, fetch_once
from netns import (BRIDGE, METADATA_IP, NetnsError, NodeNet, PodNet, call_in_netns,
                   remove_stale_namespaces)

from kiamfast.testing.apiserver import ApiServer
from kiamfast.testing import procs
from kiamfast.testing.aws_env import offline_env
from kiamfast.testing.fake_imds import FakeImds
from kiamfast.testing.sts import FaultProxy

__all__ = ["Agent", "AgentError", "Node", "Pod", "Sts", "ACCOUNT", "BASE_ARN", "ROLE_KEY",
           "STARTUP_TAINT", "REPO", "remove_stale_shared_memory", "reporting_on_failure",
           "sweep_stale_runs", "wrong_answers"]

REPO = Path(__file__).resolve().parents[2]
JS_DIR = REPO / "tests" / "js"
POD_SCRIPTS = Path(__file__).resolve().parent / "pod"
ACCOUNT = "123456789012"
BASE_ARN = f"arn:aws:iam::{ACCOUNT}:role/"
ROLE_KEY = "iam.amazonaws.com/role"
STARTUP_TAINT = "kiamfast.io/agent-not-ready"
APP_PORT = 8181
NODE_ACCESS_KEY_PREFIX = "ASIANODE"
SHM_PREFIX = "/dev/shm/kiamfast-e2e-"  # + <pid of the test process>-<random>[.token-key]

log = logging.getLogger("e2e")


class AgentError(RuntimeError):
    """The agent did not start, did not get ready, or did not stop; carries its log."""


# ---- STS ----------------------------------------------------------------------------------------

class Sts:
    """moto on ``host_ip`` (reachable from pods) behind a FaultProxy on 127.0.0.1 (the agent's).

    Construct and :meth:`start` it inside the node namespace (``call_in_netns``).
    """

    def __init__(self, host_ip: str) -> None:
        from moto.server import ThreadedMotoServer  # heavy import, tests only
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto = ThreadedMotoServer(ip_address=host_ip, port=0, verbose=False)
        self.moto_url = ""
        self.proxy: FaultProxy | None = None

    def start(self) -> "Sts":
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.moto_url = f"http://{host}:{port}"
        self.proxy = FaultProxy(self.moto_url).start()
        return self

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self._moto.stop()

    @property
    def endpoint(self) -> str:
        """The agent's ``--sts-endpoint``: the proxy on the node's loopback."""
        assert self.proxy is not None
        return self.proxy.url

    def issued(self) -> dict[str, str]:
        """AccessKeyId -> role ARN, for every successful AssumeRole so far."""
        assert self.proxy is not None
        return {c.access_key_id: c.role_arn for c in self.proxy.assume_role_calls(outcome="ok")
                if c.access_key_id}

    def role_of(self, access_key: str | None) -> str | None:
        """The role *name* STS issued ``access_key`` for (None if STS never issued it)."""
        arn = self.issued().get(access_key or "")
        return arn.rsplit("/", 1)[-1] if arn else None


# ---- the agent ----------------------------------------------------------------------------------

class Agent:
    """``python -m kiamfast`` in the node namespace, with the DaemonSet's flags."""

    def __init__(self, node: "Node", *, workers: int = 1, extra_args: Iterable[str] = (),
                 env: Mapping[str, str] | None = None, wrapper: Iterable[str] = ()) -> None:
        self.node = node
        self.wrapper = list(wrapper)   # argv the agent runs under (e.g. its mount namespace)
        tag = secrets.token_hex(4)
        self.table_path = f"{SHM_PREFIX}{os.getpid()}-{tag}"
        self.token_key_file = f"{self.table_path}.token-key"
        self.log_path = node.workdir / f"agent-{tag}.log"
        self.args = [
            f"--node={node.name}",
            f"--host-ip={node.host_ip}",
            "--iptables=true",
            f"--host-interface={node.host_interface}",
            f"--app-port={APP_PORT}",
            f"--kubeconfig={node.kubeconfig}",
            f"--metadata-addr={METADATA_IP}:80",
            f"--sts-endpoint={node.sts.endpoint}",
            f"--table-path={self.table_path}",
            f"--token-key-file={self.token_key_file}",
            f"--base-role-arn={BASE_ARN}",
            f"--node-startup-taint={STARTUP_TAINT}",
            f"--cri-endpoint={node.cri_endpoint}",
            f"--workers={workers}",
            "--debug",
            *extra_args,
        ]
        self.env = offline_env({
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(node.workdir),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(REPO),
            "PYTHONUNBUFFERED": "1",
        }, AWS_SESSION_TOKEN="testing", **(env or {}))
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._known_children: set[int] = set()

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> "Agent":
        """Start the supervisor; also again after :meth:`kill` or :meth:`stop` (same table
        file and token key, as a restarted container of the same pod)."""
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "ab")
        # The node's network namespace only, as a hostNetwork container has it: `ip netns
        # exec` would also give it a mount namespace of its own, where the pods' network
        # namespaces mounted after its start would not show (a container mounts them with
        # HostToContainer propagation).
        self.proc = subprocess.Popen(
            ["nsenter", f"--net={self.node.net.ns.path}", "--", *self.wrapper, sys.executable,
             "-m", "kiamfast", *self.args],
            env=self.env, cwd=str(REPO), stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> dict[str, int]:
        """``{"control": pid, "worker-0": pid, ...}`` of the supervisor's live children."""
        if self.proc is None:
            return {}
        out: dict[str, int] = {}
        for pid in procs.children(self.proc.pid):
            argv = procs.cmdline(pid)
            if "kiamfast.control" in argv:
                out["control"] = pid
            elif "kiamfast.server.worker" in argv:
                idx = argv[argv.index("--worker-index") + 1] if "--worker-index" in argv \
                    else str(len(out))
                out[f"worker-{idx}"] = pid
            else:
                continue
            self._known_children.add(pid)
        return out

    def wait_children(self, names: Iterable[str], *, timeout: float = 20.0,
                      not_pids: Iterable[int] = ()) -> dict[str, int]:
        """Wait until every child in ``names`` runs (with a pid not in ``not_pids``)."""
        names, old = list(names), set(not_pids)
        deadline = time.monotonic() + timeout
        while True:
            kids = self.children()
            if all(n in kids and kids[n] not in old for n in names):
                return kids
            if time.monotonic() > deadline or not self.running():
                raise AgentError(f"children {names} not running (have {kids})\n" + self.log())
            time.sleep(0.05)

    @staticmethod
    def listens(pid: int, port: int = APP_PORT) -> bool:
        """Whether process ``pid`` holds a listening TCP socket on ``port`` (IPv4 or IPv6)."""
        inodes = set()
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return False
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
        return False

    def wait_listening(self, pid: int, *, timeout: float = 20.0) -> None:
        """Wait until child ``pid`` (a worker) listens on the app port."""
        deadline = time.monotonic() + timeout
        while not self.listens(pid):
            if time.monotonic() > deadline or not self.running():
                raise AgentError(f"worker {pid} is not listening\n" + self.log())
            time.sleep(0.02)

    def readyz(self) -> int:
        """Status of ``/readyz`` on the app port (0 = no answer)."""
        try:
            return self.node.http("GET", "/readyz", timeout=1.0)[0]
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 45.0) -> None:
        """Wait for /readyz 200; fail early if the agent exits or its control process keeps
        crashing (a third control pid before ready)."""
        deadline = time.monotonic() + timeout
        controls: set[int] = set()
        while time.monotonic() < deadline:
            if not self.running():
                raise AgentError(f"agent exited with {self.proc.returncode} before ready\n"
                                 + self.log())
            if self.readyz() == 200:
                return
            control = self.children().get("control")
            if control is not None:
                controls.add(control)
            if len(controls) >= 3:
                raise AgentError("the control process keeps exiting before ready\n"
                                 + self.log())
            time.sleep(0.05)
        raise AgentError(f"agent not ready after {timeout}s\n" + self.log())

    def send_signal(self, sig: int) -> None:
        if self.running():
            os.kill(self.pid, sig)

    def stop(self, *, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        """Signal the supervisor and wait for it; SIGKILL it (and its children) if it hangs."""
        if self.proc is None:
            return None
        self.children()  # remember them, to clean up if the supervisor abandons them
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._kill_known_children()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the supervisor and all its children at once (an OOM kill of the agent's
        container): nothing gets to clean up, the DNAT rule and the table stay."""
        if self.proc is None:
            return
        pids = [self.proc.pid, *self.children().values()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self._kill_known_children()

    def _kill_known_children(self) -> None:
        for pid in self._known_children:
            argv = procs.cmdline(pid)
            if "kiamfast.control" in argv or "kiamfast.server.worker" in argv:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        try:
            self.stop(sig=signal.SIGTERM, timeout=10)
        finally:
            if self._log is not None:
                self._log.close()
            for path in (self.table_path, self.token_key_file):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

    def log(self, tail: int = 12000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[-tail:]


# ---- pods ---------------------------------------------------------------------------------------

class Pod:
    """A pod on the node: its network namespace, and its object in the emulator."""

    def __init__(self, node: "Node", net: PodNet, *, name: str, namespace: str,
                 role: str | None) -> None:
        self.node = node
        self.net = net
        self.name = name
        self.namespace = namespace
        self.role = role

    def __repr__(self) -> str:
        return f"Pod({self.namespace}/{self.name}, {self.ip}, role={self.role})"

    @property
    def ip(self) -> str:
        return self.net.ip

    # -- processes in the pod ------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        """An application's environment: no AWS_* at all unless given, a private HOME."""
        home = self.node.workdir / f"home-{self.net.ns.name}"
        home.mkdir(exist_ok=True)
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                "LANG": "C.UTF-8", **extra}

    def run(self, argv: list[str], *, env: Mapping[str, str] | None = None,
            timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        try:
            return self.net.ns.run(argv, env=env if env is not None else self.env(),
                                   timeout=timeout, cwd=str(self.node.workdir))
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"{argv[:3]} in {self} hung for {timeout}s; sockets:\n"
                                 + self.sockets()) from exc

    @staticmethod
    def _json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
        doc = json.loads(lines[-1])
        doc["exit"] = proc.returncode
        if proc.returncode != 0:
            doc.setdefault("stderr", proc.stderr[-3000:])
        return doc

    def botocore_credentials(self, *, who_am_i: bool = True, **env: str) -> dict[str, Any]:
        """botocore's default credential chain in this pod (JSON of pod/botocore_credentials)."""
        argv = [sys.executable, str(POD_SCRIPTS / "botocore_credentials.py")]
        if who_am_i:
            argv += ["--sts-endpoint", self.node.sts.moto_url]
        doc = self._json(self.run(argv, env=self.env(**env)))
        if doc.get("exit") not in (0, 3):  # crashed: say what the network looked like
            doc["sockets"] = self.sockets()
        return doc

    def sockets(self) -> str:
        """``ss`` of this pod and of the node: for failure messages."""
        return ("pod:\n" + self.net.ns.run(["ss", "-tanoi"]).stdout + "node:\n"
                + self.node.net.ns.run(["ss", "-tanoi"]).stdout
                + self.node.net.ns.run(["nstat", "-a"]).stdout)

    def awscli_identity(self) -> dict[str, Any]:
        """``aws sts get-caller-identity`` (AWS CLI v1) with credentials from the metadata
        service, against moto."""
        proc = self.run([sys.executable, "-m", "awscli", "sts", "get-caller-identity",
                         "--endpoint-url", self.node.sts.moto_url, "--region", "us-east-1",
                         "--output", "json"])
        if proc.returncode != 0 or not proc.stdout.strip().startswith("{"):
            return {"error": f"exit {proc.returncode}", "stderr": proc.stderr[-3000:]}
        return json.loads(proc.stdout)

    def js_credentials(self) -> dict[str, Any]:
        """``fromInstanceMetadata()`` of the AWS SDK for JavaScript v3 (tests/js)."""
        return self._json(self.run(["node", str(JS_DIR / "imds-credentials.js")]))

    # -- raw requests from the pod ----------------------------------------------------------

    def fetch(self, *, token: bool = True, timeout: float = 2.0) -> Sample:
        """One botocore-style credential fetch (token, listing, document) from this pod."""
        return call_in_netns(self.net.ns, fetch_once, token=token, timeout=timeout)

    def wait_credentials(self, *, timeout: float = 20.0) -> Sample:
        """Fetch until a credential document comes back (for tests not about timing)."""
        deadline = time.monotonic() + timeout
        sample = self.fetch()
        while not sample.ok and time.monotonic() < deadline:
            time.sleep(0.05)
            sample = self.fetch()
        return sample

    def prober(self, *, interval: float = 0.02, token: bool = True) -> Prober:
        return Prober(self.net.ns, interval=interval, token=token, label=self.name)

    # -- netfilter in the pod (the v1 path: the token PUT is refused) ------------------------

    _REFUSE_PUT = ["OUTPUT", "-p", "tcp", "-d", METADATA_IP, "--dport", "80", "-m", "string",
                   "--algo", "bm", "--string", "PUT /latest/api/token", "-j", "REJECT",
                   "--reject-with", "tcp-reset"]

    def refuse_token_put(self) -> None:
        """Make this pod's token PUTs die with a TCP reset, as on a host without IMDSv2.

        botocore then falls back to IMDSv1 (token-less GETs)."""
        self.net.ns.run(["iptables", "-I", *self._REFUSE_PUT], check=True)

    def allow_token_put(self) -> None:
        """Undo :meth:`refuse_token_put`."""
        self.net.ns.run(["iptables", "-D", *self._REFUSE_PUT], check=True)

    def refused_token_puts(self) -> int:
        """Packets the rule of :meth:`refuse_token_put` has refused so far."""
        out = self.net.ns.run(["iptables", "-L", "OUTPUT", "-v", "-n", "-x"], check=True)
        for line in out.stdout.splitlines():
            if "REJECT" in line and "STRING" in line.upper():
                return int(line.split()[0])
        return 0


# ---- the node -----------------------------------------------------------------------------------

class Node:
    """A node namespace with the fake IMDS, the API server emulator, STS, and
    (after :meth:`start_agent`) the agent. Use as a context manager, or call :meth:`close`."""

    # The agent's --host-interface and --cri-endpoint on this node: pods are veths on the
    # harness' bridge and there is no container runtime (runtime_node.RuntimeNode has one).
    host_interface = BRIDGE
    cri_endpoint = "none"

    def __init__(self, workdir: Path, *, taint: bool = True,
                 host_ip: str = "10.77.0.1") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pods: dict[str, Pod] = {}
        self.agents: list[Agent] = []
        self.imds: FakeImds | None = None
        self.api: ApiServer | None = None
        self.sts_: Sts | None = None
        self.net = NodeNet(host_ip=host_ip)
        try:
            self._start_services(taint=taint)
        except BaseException:
            self.close()
            raise

    def _start_services(self, *, taint: bool) -> None:
        ns = self.net.ns
        self.imds = call_in_netns(ns, lambda: FakeImds(METADATA_IP, 80).start())
        self.sts_ = call_in_netns(ns, lambda: Sts(self.host_ip).start())
        self._start_api(taint=taint)

    def _start_api(self, *, taint: bool) -> None:
        """The API server emulator with this node registered; sets ``self.kubeconfig``."""
        ns = self.net.ns
        self.api = call_in_netns(ns, lambda: ApiServer("127.0.0.1", 0).start())
        self.kubeconfig = self.api.write_kubeconfig(self.workdir / "kubeconfig")
        taints = [{"key": STARTUP_TAINT, "effect": "NoSchedule"}] if taint else None
        self.api.nodes.add(self.name, taints=taints, address=self.host_ip)

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def name(self) -> str:
        return self.net.name

    @property
    def host_ip(self) -> str:
        return self.net.host_ip

    @property
    def sts(self) -> Sts:
        assert self.sts_ is not None
        return self.sts_

    # -- the agent -----------------------------------------------------------------------

    def agent(self, **kwargs: Any) -> Agent:
        """A new, not yet started agent for this node."""
        agent = Agent(self, **kwargs)
        self.agents.append(agent)
        return agent

    def start_agent(self, *, wait_ready: bool = True, **kwargs: Any) -> Agent:
        agent = self.agent(**kwargs).start()
        if wait_ready:
            agent.wait_ready()
        return agent

    def http(self, method: str, path: str, *, host: str = "127.0.0.1", port: int = APP_PORT,
             headers: Mapping[str, str] | None = None,
             timeout: float = 2.0) -> tuple[int, bytes]:
        """One HTTP request from inside the node namespace (e.g. the agent's /readyz)."""
        def go() -> tuple[int, bytes]:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                conn.request(method, path, headers=dict(headers or {}))
                resp = conn.getresponse()
                return resp.status, resp.read()
            finally:
                conn.close()
        return call_in_netns(self.net.ns, go)

    def dnat_rules(self) -> list[str]:
        return self.net.dnat_rules()

    def taints(self) -> list[str]:
        assert self.api is not None
        return [t["key"] for t in self.api.nodes.get(self.name).get("spec", {}).get("taints", [])]

    # -- pods ----------------------------------------------------------------------------

    def add_pod(self, name: str, ip: str, *, role: str | None = None,
                namespace: str = "default", in_api: bool = True, ip_in_api: bool = True,
                phase: str = "Running",
                annotations: Mapping[str, str] | None = None) -> Pod:
        """A pod namespace with ``ip`` and (``in_api``) the pod in the emulator.

        ``ip_in_api=False``: the API server has the pod without an IP (Pending), as in the
        first seconds of a real pod's life."""
        net = self.net.add_pod(ip)
        pod = Pod(self, net, name=name, namespace=namespace, role=role)
        self.pods[name] = pod
        if in_api:
            self.create_pod_object(pod, ip_in_api=ip_in_api, phase=phase,
                                   annotations=annotations)
        return pod

    def create_pod_object(self, pod: Pod, *, ip_in_api: bool = True,
                          phase: str = "Running",
                          annotations: Mapping[str, str] | None = None) -> None:
        assert self.api is not None
        ann = dict(annotations or {})
        if pod.role is not None:
            ann[ROLE_KEY] = pod.role
        if ip_in_api:
            self.api.pods.create(pod.namespace, pod.name, node=self.name, annotations=ann,
                                 ips=[pod.ip], phase=phase)
        else:
            self.api.pods.create(pod.namespace, pod.name, node=self.name, annotations=ann,
                                 phase="Pending")

    def remove_pod_net(self, pod: Pod) -> None:
        """The pod's sandbox is gone (its namespace deleted); the API object is untouched."""
        self.net.remove_pod(pod.net)

    # -- checks ----------------------------------------------------------------------------

    def imds_credential_requests(self) -> list[str]:
        """Paths of requests for credentials that reached the fake IMDS (must stay empty)."""
        assert self.imds is not None
        return [r.path for r in self.imds.requests
                if "security-credentials" in r.path or "identity-credentials" in r.path]

    # -- teardown ------------------------------------------------------------------------

    def _stoppers(self) -> list[Callable[[], None]]:
        """What stops between the agents and the node's services, in order: nothing here;
        a node with a container runtime (and a kubelet) stops those."""
        return []

    def close(self) -> None:
        errors: list[BaseException] = []
        for agent in self.agents:
            try:
                agent.close()
            except BaseException as exc:  # noqa: BLE001 - keep cleaning up
                errors.append(exc)
        for stop in (*self._stoppers(), getattr(self.api, "stop", None),
                     getattr(self.sts_, "stop", None), getattr(self.imds, "stop", None)):
            if stop is None:
                continue
            try:
                stop()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        try:
            self.net.destroy()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        if errors:
            raise NetnsError(f"cleanup of {self.name} failed: {errors!r}") from errors[-1]

    def agent_logs(self) -> str:
        return "\n".join(f"--- agent {a.pid if a.proc else '-'} ---\n{a.log()}"
                         for a in self.agents)

    def failure_report(self) -> list[tuple[str, str]]:
        """(title, text) of what to read first when a test on this node failed."""
        return [("agent output", self.agent_logs())] if self.agents else []


@contextlib.contextmanager
def reporting_on_failure(node: Node, failed: Callable[[], bool]) -> Iterator[Node]:
    """For a fixture: yields ``node``, then closes it, printing its failure_report() first
    when ``failed()`` says the test failed."""
    try:
        yield node
    finally:
        if failed():
            for title, text in node.failure_report():
                sys.stdout.write(f"\n===== {title} =====\n{text}\n")
        node.close()


def sweep_stale_runs() -> None:
    """What test runs killed half-way left: node namespaces (and the agents in them), table
    files."""
    remove_stale_namespaces()
    remove_stale_shared_memory()


def remove_stale_shared_memory() -> None:
    """Remove the table files of test runs that died before cleaning up (pid gone)."""
    shm = os.path.dirname(SHM_PREFIX)
    base = os.path.basename(SHM_PREFIX)
    for name in os.listdir(shm):
        if not name.startswith(base):
            continue
        pid = name[len(base):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(shm, name))
            except OSError:
                pass


def wrong_answers(pod: Pod, samples: Iterable[Sample], *,
                  allowed_errors: Iterable[int] = (503, 404)) -> list[str]:
    """Every sample that was not this pod's own role or an allowed error, described.

    A credential document counts as the pod's own only if STS issued its AccessKeyId for
    the pod's role (so neither the node's role nor another pod's can pass)."""
    allowed = set(allowed_errors)
    bad = []
    for s in samples:
        if s.access_key and s.access_key.startswith(NODE_ACCESS_KEY_PREFIX):
            bad.append(f"NODE ROLE LEAKED: {s}")
        elif s.status == 200 and s.role != pod.role:
            bad.append(f"listing named {s.role!r}, pod's role is {pod.role!r}: {s}")
        elif s.ok and pod.node.sts.role_of(s.access_key) != pod.role:
            bad.append(f"key issued for {pod.node.sts.role_of(s.access_key)!r}, pod's role "
                       f"is {pod.role!r}: {s}")
        elif s.status != 200 and s.status not in allowed:
            bad.append(f"status {s.status} ({s.stage}) not in {sorted(allowed)}: {s}")
    return bad


def assert_own_role(pod: "Pod", creds: dict) -> None:
    """The SDK in `pod` got credentials, and STS issued them for this pod's role (never the
    node's)."""
    node = pod.node
    assert "AccessKeyId" in creds, f"{pod}: no credentials: {creds}\n" + node.agent_logs()
    key = creds["AccessKeyId"]
    assert not key.startswith(NODE_ACCESS_KEY_PREFIX), f"{pod} got the NODE's role: {creds}"
    assert node.sts.role_of(key) == pod.role, \
        f"{pod}: key {key} was issued for {node.sts.role_of(key)!r}"
    if "Arn" in creds:
        assert f":assumed-role/{pod.role}/" in creds["Arn"], creds
