"""Fixtures for the credential manager: moto's STS behind the fault proxy, a real table file.

Every AWS client here uses static credentials and AWS_EC2_METADATA_DISABLED=true, and talks
only to 127.0.0.1. Tests are plain functions that run their scenario with ``h.run(...)``
(no asyncio plugin needed).
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import pytest

from kiamfast import table as tbl
from kiamfast import credential_parts
from kiamfast.control.iam.keys import CredentialRequest
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.iam.sts import StsClient
from kiamfast.testing.aws_env import offline
from kiamfast.testing.sts import FaultProxy, MotoSts

ACCOUNT = "123456789012"
BASE_ARN = f"arn:aws:iam::{ACCOUNT}:role/"


def role(name: str) -> str:
    return BASE_ARN + name


def req(role_name: str, *, pod: str = "p", namespace: str = "ns", sa: str = "default",
        external_id: str | None = None, ip: str | None = None) -> CredentialRequest:
    arn = role_name if role_name.startswith("arn:") else role(role_name)
    return CredentialRequest(role_arn=arn, external_id=external_id, namespace=namespace,
                             pod_name=pod, service_account=sa, pod_ip=ip)


@pytest.fixture(scope="session", autouse=True)
def aws_env():
    with offline():
        yield


@pytest.fixture(scope="session")
def moto_sts(aws_env):
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with MotoSts() as server:
        yield server


@pytest.fixture
def proxy(moto_sts):
    with FaultProxy(moto_sts.url) as p:
        yield p


@pytest.fixture
def sts(proxy):
    client = StsClient(endpoint_url=proxy.url, region="us-east-1", max_attempts=1,
                       connect_timeout=2, read_timeout=10, max_pool_connections=16)
    yield client
    client.close()


class Harness:
    """A table file, the STS client, and a manager factory that runs inside ``run``."""

    def __init__(self, *, table: tbl.Table, sts: StsClient, proxy: FaultProxy):
        self.table = table
        self.sts = sts
        self.proxy = proxy
        self.notified = 0
        self.capacity = table.layout["cred_capacity"]

    def notify(self) -> None:
        self.notified += 1

    role = staticmethod(role)
    req = staticmethod(req)
    base_arn = BASE_ARN

    @contextlib.asynccontextmanager
    async def manager(self, **kwargs):
        kwargs.setdefault("table", self.table)
        kwargs.setdefault("sts", self.sts)
        kwargs.setdefault("capacity", self.capacity)
        kwargs.setdefault("notify", self.notify)
        kwargs.setdefault("node_name", "node-1")
        kwargs.setdefault("base_role_arn", BASE_ARN)
        kwargs.setdefault("qps", 1000.0)
        kwargs.setdefault("burst", 1000)
        samples = kwargs.pop("registry", None)
        mgr = CredentialManager(**kwargs)
        if samples is not None:
            samples.metrics = mgr.metrics
        task = asyncio.create_task(mgr.run())
        try:
            yield mgr
        finally:
            mgr.close()
            await task

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    def state(self, slot: int) -> tuple[int, float, list[bytes]]:
        return self.table.read_cred(slot)

    async def wait_state(self, slot: int, *states: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            state = self.table.read_cred(slot)[0]
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"slot {slot} stayed in state {state}, wanted {states}")
            await asyncio.sleep(0.005)

    def document(self, slot: int) -> dict:
        import orjson
        parts = self.table.read_cred(slot)[2]
        status, headers, body = credential_parts.parse_response(parts[tbl.PART_DOCUMENT])
        assert status == 200
        return orjson.loads(body)


@pytest.fixture
def h(tmp_path, sts, proxy):
    t = tbl.Table.create(str(tmp_path / "table"), ip_capacity=1024, cred_capacity=512,
                         value_size=8192, aux_count=1, aux_size=4096, max_workers=1)
    yield Harness(table=t, sts=sts, proxy=proxy)
    t.close()


# ---- a worker stand-in: serves the rendered parts as-is, for real SDK clients ----------------

class ImdsStub:
    """Serves a credential slot's parts on loopback, the way a worker writes them.

    Only the three routes botocore's IMDS credential fetcher uses: the token PUT, the
    listing, and the document for a listed name (404 for any other name).
    """

    def __init__(self, parts_of):
        self._parts_of = parts_of  # () -> list[bytes]
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/"
        self.requests: list[str] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._stop = False

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._sock.close()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

    def _conn(self, conn: socket.socket):
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                method, path = head.split(b"\r\n")[0].split()[:2]
                self.requests.append(f"{method.decode()} {path.decode()}")
                conn.sendall(self._answer(method, path.decode()))

    def _answer(self, method: bytes, path: str) -> bytes:
        if method == b"PUT" and path == "/latest/api/token":
            body = b"A" * 56
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nServer: EC2ws\r\n"
                    b"X-Aws-Ec2-Metadata-Token-Ttl-Seconds: 21600\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        parts = self._parts_of()
        prefix = "/latest/meta-data/iam/security-credentials/"
        if path in (prefix, prefix[:-1]):
            return parts[tbl.PART_LISTING]
        if path.startswith(prefix):
            names = parts[tbl.PART_NAMES].decode().split("\n")
            if path[len(prefix):] in names:
                return parts[tbl.PART_DOCUMENT]
        return b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nServer: EC2ws\r\n\r\n"


@pytest.fixture
def imds_stub():
    """Factory: ``with imds_stub(lambda: parts) as stub: ...``."""
    return ImdsStub

