"""The worker as the supervisor runs it: a separate process, an inherited channel fd, one
inherited listening socket shared by several workers, SIGTERM, and no control-side
imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kiamfast import channel, table
from kiamfast.server import metrics
from kiamfast.server.settings import WorkerSettings
from kiamfast.server.worker import listen_socket
from kiamfast.testing.net import free_port, wait_port

from server_support import TOKEN_KEY, Client, build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIST = "/latest/meta-data/iam/security-credentials/"


def wait_logged(proc: subprocess.Popen, text: str, timeout: float = 15.0) -> None:
    """Read the worker's stderr until `text` shows up (the port alone cannot tell which of
    two workers on one socket is listening)."""
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = proc.stderr.readline()
            if text in line:
                return
            assert line or proc.poll() is None, proc.communicate()
    raise AssertionError(f"worker never logged {text!r}")


def start(table_path: str, settings: WorkerSettings, *, index: int = 0,
          channel_fd: int | None = None, listen_fd: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiamfast.server.worker", "--table", table_path,
           "--worker-index", str(index), "--settings-json", settings.to_json()]
    fds: tuple[int, ...] = ()
    if channel_fd is not None:
        cmd += ["--channel-fd", str(channel_fd)]
        fds = (channel_fd,)
    if listen_fd is not None:
        cmd += ["--listen-fd", str(listen_fd)]
        fds += (listen_fd,)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(cmd, env=env, pass_fds=fds, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture
def settings(imds):
    return WorkerSettings(app_port=free_port(), metadata_addr=imds.addr, token_key=TOKEN_KEY)


def test_worker_process_serves_talks_to_control_and_stops_on_sigterm(table_path, pods,
                                                                     settings):
    pods.add("127.0.0.1", "app-role")
    pods.ready(synced=False)
    ctl, worker_end = channel.socketpair()
    proc = start(table_path, settings, channel_fd=worker_end.fileno())
    worker_end.close()
    try:
        wait_port(settings.app_port, proc, timeout=15)
        with Client(settings.app_port) as c:
            assert c.request(build("GET", LIST)).body == b"app-role"
        # with the runtime's view: a new connection asks the control process (us) for a
        # poll begun after it was accepted, and waits for the table
        pods.t.set_status(runtime_mode=True)
        before = time.monotonic_ns()
        with Client(settings.app_port, source="127.0.0.44") as c:
            c.send(build("GET", LIST))
            ctl.settimeout(5)
            kind, accepted = channel.parse(ctl.recv(64))
            assert kind == channel.NEED_RUNTIME and accepted >= before
            pods.add("127.0.0.44", "late-role")
            pods.t.set_verified(accepted)
            channel.send(ctl, channel.wake(pods.t.generation))
            assert c.read(1)[0].body == b"late-role"
    finally:
        code = stop(proc)
        ctl.close()
    assert code == 0, proc.stderr.read()


def test_two_workers_share_the_port(table_path, pods, settings):
    """As under the supervisor: one socket bound once, inherited by both workers."""
    pods.add("127.0.0.1", "app-role")
    listener = listen_socket(None, settings.app_port)
    procs = [start(table_path, settings, index=i, listen_fd=listener.fileno())
             for i in range(2)]
    listener.close()   # the workers hold it now
    try:
        for p in procs:
            wait_logged(p, "worker listening")
        for _ in range(40):
            with Client(settings.app_port) as c:
                assert c.request(build("GET", LIST)).body == b"app-role"
        assert stop(procs[0]) == 0  # the other one keeps serving the port alone
        for _ in range(10):
            with Client(settings.app_port) as c:
                assert c.request(build("GET", LIST)).body == b"app-role"
    finally:
        for p in procs:
            if p.poll() is None:
                stop(p)
    # Each worker flushed its counters into its own row on exit; the sum has them all.
    assert pods.t.counters_sum()[metrics.CONNECTIONS] >= 50


def test_bad_settings_exit_with_a_message(table_path, pods):
    proc = subprocess.run(
        [sys.executable, "-m", "kiamfast.server.worker", "--table", table_path,
         "--settings-json", '{"imdsv2": "sometimes"}'],
        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "imdsv2" in proc.stderr


def test_missing_table_exits_with_a_message(tmp_path, settings):
    proc = subprocess.run(
        [sys.executable, "-m", "kiamfast.server.worker", "--table", str(tmp_path / "none"),
         "--settings-json", settings.to_json()],
        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "table" in proc.stderr


IMPORT_CHECK = r"""
import asyncio, json, socket, sys
import uvloop
from kiamfast import table
from kiamfast.server.settings import WorkerSettings
from kiamfast.server.worker import listen_socket, serve

async def main():
    t = table.Table.attach(sys.argv[1])
    ws = await serve(WorkerSettings(metadata_addr=sys.argv[2], token_key=b"k" * 32), t,
                     app_sock=listen_socket("127.0.0.1", 0, reuse_port=False))
    loop = asyncio.get_running_loop()
    def fetch():
        with socket.create_connection(("127.0.0.1", ws.port)) as s:
            s.sendall(b"GET /latest/meta-data/instance-id HTTP/1.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        return data
    data = await loop.run_in_executor(None, fetch)
    await ws.close()
    return data

data = uvloop.run(main())
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("kubernetes", "botocore", "boto3", "urllib3", "grpc",
                                      "cri_api")
               or m.startswith("kiamfast.control"))
print(json.dumps({"heavy": heavy, "ok": data.startswith(b"HTTP/1.1 200")}))
"""


def test_a_worker_never_imports_kubernetes_or_botocore(table_path, pods, imds):
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK, table_path, imds.addr],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"]
    assert out["heavy"] == []


def test_sigterm_lets_an_outstanding_answer_finish(table_path, pods, settings):
    """A request waiting for its credentials when SIGTERM arrives still gets its answer."""
    pods.add("127.0.0.1", "slow-role", state=table.CRED_PENDING)
    settings = WorkerSettings(**{**settings.__dict__, "wait_budget": 0.8})
    proc = start(table_path, settings)
    try:
        wait_port(settings.app_port, proc, timeout=15)
        idle = Client(settings.app_port)
        with Client(settings.app_port) as c:
            c.send(build("GET", LIST))
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            r = c.read(1)
        assert r and r[0].status == 503  # answered (budget ran out), not cut off
        assert idle.wait_closed(timeout=5)  # idle keep-alive connections are closed
        idle.close()
    finally:
        if proc.poll() is None:
            stop(proc)
    assert proc.wait(10) == 0
