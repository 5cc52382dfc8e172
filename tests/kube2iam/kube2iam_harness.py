"""kube2iam and kiamfast side by side: one emulated cluster, one STS, one metadata service.

Both agents watch the same API server emulator (kube2iam through client-go and a kubeconfig),
call the same STS (moto behind the recording proxy of ``kiamfast.testing.sts``) and proxy
to the same fake IMDS, all on 127.0.0.1.  Pods are loopback source addresses (127.0.0.x), so
a request "from a pod" is a connection bound to that address; neither agent needs root.

kube2iam is the real binary built by tests/tools/build_kube2iam.sh (commit 4c4a2b4).  It
calls AWS through the Go SDK: ``AWS_ENDPOINT_URL`` sends STS to the proxy, a region no
partition lists (``kf-local-1``) keeps its regional resolver from picking an AWS host, and
``HTTPS_PROXY``/``HTTP_PROXY`` point at a closed loopback port so that any other host it might
try fails on the spot (Go never proxies loopback addresses).  Before its first AssumeRole it
asks EC2 ``DescribeRegions`` (to decide whether to use a regional STS host): moto has no EC2
for an unlisted region, so ``AWS_ENDPOINT_URL_EC2`` points at :class:`NoRegionsEc2`, which
lists none, as kube2iam's own end-to-end test does.  Its health check reads the
fake IMDS through ``AWS_EC2_METADATA_SERVICE_ENDPOINT``.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent_process import Agent, exchange, free_port
from kiamfast.testing.apiserver import ApiServer
from kiamfast.testing.background import BackgroundServer
from kiamfast.testing.fake_imds import FakeImds
from kiamfast.testing.sts import StsSandbox

NODE = "n1"
ACCOUNT = "123456789012"
BASE_ARN = f"arn:aws:iam::{ACCOUNT}:role/"
REGION = "kf-local-1"
BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "build_kube2iam.sh"


# Why a kube2iam test or benchmark cannot run here: the same words everywhere (tests/kube2iam,
# tests/bench, bench/run), and a skip outside CI only (CI=true turns it into a failure).
MISSING = "needs kube2iam: run tests/tools/build_kube2iam.sh"


def kube2iam_binary() -> Path | None:
    """Where build_kube2iam.sh puts the binary, or None when it has not been built."""
    version = re.search(r"^KUBE2IAM_VERSION=(\S+)$", BUILD_SCRIPT.read_text(), re.M).group(1)
    tools = Path(os.environ.get("KIAMFAST_TOOLS", Path.home() / ".cache/kiamfast/tools"))
    path = tools / f"kube2iam-{version}" / "kube2iam"
    return path if path.is_file() else None


class Cluster:
    """The shared fakes; ``sts`` is the recording proxy in front of moto."""

    def __init__(self) -> None:
        # No token: client-go's clientcmd reads a kubeconfig's credentials only for a TLS
        # server, and the emulator speaks plain http.
        self.api = ApiServer(token=None).start()
        self.sandbox = StsSandbox().start()
        self.imds = FakeImds().start()
        self.ec2 = NoRegionsEc2().start()
        self.api.add_node(NODE)

    @property
    def sts(self):
        return self.sandbox.proxy

    def role_issued(self, access_key_id: str) -> str | None:
        """The RoleArn of the AssumeRole call whose answer carried this key, if any."""
        for call in self.sts.assume_role_calls(outcome="ok"):
            if call.access_key_id == access_key_id:
                return call.role_arn
        return None

    def stop(self) -> None:
        self.ec2.stop()
        self.imds.stop()
        self.sandbox.stop()
        self.api.stop()


class NoRegionsEc2(BackgroundServer):
    """EC2's DescribeRegions on 127.0.0.1, answering an empty list to every call."""

    BODY = (b'<DescribeRegionsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
            b"<requestId>00000000-0000-0000-0000-000000000000</requestId>"
            b"<regionInfo/></DescribeRegionsResponse>")

    def start(self) -> "NoRegionsEc2":
        body = self.BODY

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 (http.server naming)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "text/xml;charset=UTF-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._serve(server, name="no-regions-ec2")
        return self


class Kube2iam(Agent):
    """One run of the real kube2iam on <port> (all interfaces, as it binds) against
    ``cluster``.  Started its own way; logs and stops like the agent (SIGTERM, then the
    process group)."""

    name = "kube2iam"

    def __init__(self, cluster: Cluster, workdir: Path, flags: list[str]) -> None:
        binary = kube2iam_binary()
        assert binary is not None, "kube2iam is not built: run tests/tools/build_kube2iam.sh"
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = workdir / "kube2iam.log"
        kubeconfig = cluster.api.write_kubeconfig(workdir / "kubeconfig")
        argv = [str(binary), f"--kubeconfig={kubeconfig}", f"--node={NODE}",
                "--iptables=false", "--host-ip=127.0.0.1", f"--app-port={self.port}",
                f"--metrics-port={self.port}", f"--metadata-addr={cluster.imds.addr}", *flags]
        env = kube2iam_env(workdir, sts_url=cluster.sts.url, ec2_url=cluster.ec2.url,
                           imds_url=cluster.imds.url)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                         start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """kube2iam listens once its informers have synced and its first health check ran."""
        wait_listening(self.proc, self.port, self.log, timeout)


class Kiamfast(Agent):
    """The agent in API-only mode (``--cri-endpoint=none``), kube2iam's flags otherwise.
    Ready only once every pod's credentials are fetched, however slow this machine's STS:
    the record is of a settled agent, not of its first seconds."""

    name = "kiamfast"

    def __init__(self, cluster: Cluster, workdir: Path, flags: list[str]) -> None:
        super().__init__(_AgentFakes(cluster), workdir,
                         extra=["--listen-host=127.0.0.1", "--ready-prefetch-timeout=120s",
                                *flags])

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Ready, and the control process has published once since: until then a namespace
        denial has a generic text instead of kube2iam's (the texts come with the metrics)."""
        super().wait_ready(timeout)
        deadline = time.monotonic() + timeout
        while b"kiamfast_ready 1" not in request(self.port, "GET", "/metrics",
                                                  source="127.0.0.1")[2]:
            assert time.monotonic() < deadline, "kiamfast never published:\n" + self.log()
            time.sleep(0.1)


class _AgentFakes:
    """The attributes tests/agent_process.Agent reads from its fakes."""

    def __init__(self, cluster: Cluster) -> None:
        self.api = cluster.api
        self.sts = cluster.sts
        self.imds = cluster.imds


def kube2iam_env(workdir: Path, *, sts_url: str, ec2_url: str, imds_url: str,
                 direct: tuple[str, ...] = ()) -> dict[str, str]:
    """kube2iam's environment (see the module docstring): STS, EC2 and the metadata service
    at the given URLs, every other host a dead end; ``direct``: non-loopback hosts it may
    reach without the dead-end proxy (e.g. 169.254.169.254 on a test's node)."""
    dead_end = f"http://127.0.0.1:{closed_port()}"
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "TZ": "UTC",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": REGION, "AWS_ENDPOINT_URL": sts_url,
           "AWS_ENDPOINT_URL_EC2": ec2_url,
           "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_url,
           "HTTPS_PROXY": dead_end, "HTTP_PROXY": dead_end}
    if direct:
        env["NO_PROXY"] = ",".join(direct)
    return env


def wait_listening(proc: subprocess.Popen, port: int, log, timeout: float) -> None:
    """Until kube2iam (``proc``) accepts connections on 127.0.0.1:<port>; ``log()`` for
    the failure message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kube2iam exited:\n" + log()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("kube2iam never listened:\n" + log())


def closed_port() -> int:
    """A loopback port nothing listens on (bound and released: nothing takes it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port: int, method: str, path: str, *, source: str,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh connection from ``source``: status, headers, body."""
    raw = exchange(port, method, path, source=source, headers=headers, timeout=15)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    if fields.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    if method == "HEAD":
        body = b""
    return int(lines[0].split()[1]), fields, body


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2:]
    return out


class BenchKube2iam:
    """kube2iam against a bench/bench_agent.Cluster (its API server wants a token: given
    with ``--api-server``/``--api-token``), on loopback, the way bench/churn.py runs
    kiamfast: the same port for the app and metrics, no iptables, API-only as it always is.
    Use as a context manager; ``port``, ``wait_ready`` and ``log_tail`` as bench_agent.Agent."""

    def __init__(self, c, *, host_ip: str, base_role_arn: str) -> None:
        binary = kube2iam_binary()
        assert binary is not None, "kube2iam is not built: run tests/tools/build_kube2iam.sh"
        self.ec2 = NoRegionsEc2().start()
        self.port = free_port()
        self.log_path = Path(c.tmp) / f"kube2iam-{self.port}.log"
        argv = [str(binary), f"--api-server={c.api.url}", f"--api-token={c.api.token}",
                f"--node={c.node}", "--iptables=false", f"--host-ip={host_ip}",
                f"--app-port={self.port}", f"--metrics-port={self.port}",
                f"--metadata-addr=127.0.0.1:{c.imds_port}", f"--base-role-arn={base_role_arn}"]
        env = kube2iam_env(Path(c.tmp), sts_url=c.proxy.url, ec2_url=self.ec2.url,
                           imds_url=f"http://127.0.0.1:{c.imds_port}")
        self.started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log,
                                         start_new_session=True)

    def __enter__(self) -> "BenchKube2iam":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, 9)
                    self.proc.wait(10)
        finally:
            self.ec2.stop()

    def wait_ready(self, timeout: float = 60.0) -> float:
        """Seconds from start until it listens (after its informers synced)."""
        wait_listening(self.proc, self.port, self.log_tail, timeout)
        return time.monotonic() - self.started

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""
