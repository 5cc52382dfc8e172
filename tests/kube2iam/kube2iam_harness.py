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
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent_process import Agent, exchange
from kiamfast.testing.background import BackgroundServer
from kiamfast.testing.loopback import AgentProcess, LoopbackNode
from kiamfast.testing.net import free_port

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


class Cluster(LoopbackNode):
    """The shared loopback node, started; ``sts`` is the recording proxy in front of moto."""

    def __init__(self) -> None:
        # No token: client-go's clientcmd reads a kubeconfig's credentials only for a TLS
        # server, and the emulator speaks plain http.
        super().__init__(node=NODE, api_token=None)
        self.start()


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


class Kube2iam(AgentProcess):
    """One run of the real kube2iam on <port> (all interfaces, as it binds) for ``node``'s
    node, with an EC2 of its own (see the module docstring); logs and stops like the agent
    (SIGTERM, then the process group)."""

    name = "kube2iam"

    def __init__(self, node: LoopbackNode, workdir: Path, flags: list[str]) -> None:
        binary = kube2iam_binary()
        assert binary is not None, "kube2iam is not built: run tests/tools/build_kube2iam.sh"
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        # An emulator with a token is named by flags: client-go's clientcmd reads a
        # kubeconfig's credentials only for a TLS server.
        api = ([f"--api-server={node.api.url}", f"--api-token={node.api.token}"]
               if node.api.token else [f"--kubeconfig={node.kubeconfig}"])
        argv = [str(binary), *api, f"--node={node.node}", "--iptables=false",
                f"--host-ip={node.host_ip}", f"--app-port={port}", f"--metrics-port={port}",
                f"--metadata-addr={node.imds_addr}", *flags]
        self.ec2 = NoRegionsEc2().start()
        try:
            super().__init__(argv, port=port, log_path=workdir / "kube2iam.log", env=kube2iam_env(
                workdir, sts_url=node.sts.url, ec2_url=self.ec2.url,
                imds_url=f"http://{node.imds_addr}"))
        except BaseException:
            self.ec2.stop()
            raise

    def wait_ready(self, timeout: float = 60.0, *, poll: float = 0.05) -> float:
        """kube2iam listens once its informers have synced and its first health check ran:
        seconds from its start until then."""
        return self.wait_listening(timeout)

    def stop(self, timeout: float = 20.0) -> int:
        try:
            return super().stop(timeout)
        finally:
            self.ec2.stop()


class Kiamfast(Agent):
    """The agent in API-only mode (``--cri-endpoint=none``), kube2iam's flags otherwise.
    Ready only once every pod's credentials are fetched, however slow this machine's STS:
    the record is of a settled agent, not of its first seconds."""

    name = "kiamfast"

    def __init__(self, cluster: Cluster, workdir: Path, flags: list[str]) -> None:
        super().__init__(cluster, workdir,
                         extra=["--listen-host=127.0.0.1", "--ready-prefetch-timeout=120s",
                                *flags])

    def wait_ready(self, timeout: float = 60.0, *, poll: float = 0.05) -> float:
        """Ready, and the control process has published once since: until then a namespace
        denial has a generic text instead of kube2iam's (the texts come with the metrics)."""
        super().wait_ready(timeout, poll=poll)
        deadline = time.monotonic() + timeout
        while b"kiamfast_ready 1" not in request(self.port, "GET", "/metrics",
                                                  source="127.0.0.1")[2]:
            assert time.monotonic() < deadline, "kiamfast never published:\n" + self.log()
            time.sleep(0.1)
        return time.monotonic() - self.started


def kube2iam_env(workdir: Path, *, sts_url: str, ec2_url: str, imds_url: str,
                 direct: tuple[str, ...] = ()) -> dict[str, str]:
    """kube2iam's environment (see the module docstring): STS, EC2 and the metadata service
    at the given URLs, every other host a dead end; ``direct``: non-loopback hosts it may
    reach without the dead-end proxy (e.g. 169.254.169.254 on a test's node)."""
    dead_end = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir), "TZ": "UTC",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_REGION": REGION, "AWS_ENDPOINT_URL": sts_url,
           "AWS_ENDPOINT_URL_EC2": ec2_url,
           "AWS_EC2_METADATA_SERVICE_ENDPOINT": imds_url,
           "HTTPS_PROXY": dead_end, "HTTP_PROXY": dead_end}
    if direct:
        env["NO_PROXY"] = ",".join(direct)
    return env


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
