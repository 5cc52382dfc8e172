"""The injection webhook's HTTPS server on loopback: what any pod reaching its Service can do
to it (slow, idle or too many connections, oversized bodies) never stops the API server's
calls from being answered.
"""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time

import kube
import pytest

from kiamfast.webhook import cli as webhook_cli
from kiamfast.webhook import server as webhook_server

SETTINGS = {"role_key": "iam.amazonaws.com/role", "audience": "kiamfast.io/container-credentials",
            "expiration": 600}


@pytest.fixture
def server(tmp_path):
    pki = kube.make_pki(tmp_path / "pki")
    srv = webhook_server.make_server(listen=("127.0.0.1", 0), cert=str(pki["cert"]),
                              key=str(pki["key"]), settings=SETTINGS, max_connections=2)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.ca = pki["ca"]
    yield srv
    srv.shutdown()
    srv.server_close()


def post(server, body: bytes, headers: dict | None = None, timeout: float = 10.0):
    context = ssl.create_default_context(cafile=str(server.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=context,
                                       timeout=timeout)
    try:
        conn.request("POST", "/mutate", body, headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def review(uid: str) -> bytes:
    return json.dumps({"request": {"uid": uid, "operation": "CREATE", "kind": {"kind": "Pod"},
                                   "object": {"metadata": {}, "spec": {}}}}).encode()


def test_a_review_over_tls_is_answered(server):
    status, body = post(server, review("u-1"))
    assert status == 200
    assert json.loads(body)["response"] == {"uid": "u-1", "allowed": True}


def test_a_body_over_the_bound_is_refused_unread(server):
    status, _ = post(server, b"", {"Content-Length": str(webhook_server.MAX_REVIEW_BYTES + 1)})
    assert status == 413


def test_a_client_that_never_handshakes_does_not_hold_up_others(server):
    with socket.create_connection(server.server_address):    # TCP only, no TLS hello
        status, _ = post(server, review("u-2"))
    assert status == 200


def test_connections_beyond_the_bound_are_closed_and_served_again_once_freed(server):
    # Accepted in order by the one accepting thread: the two idle ones take both slots.
    idle = [socket.create_connection(server.server_address) for _ in range(2)]
    with socket.create_connection(server.server_address) as third:
        # Closed at once, not after the handshake's read timeout as an idle one would be.
        third.settimeout(webhook_server.READ_TIMEOUT / 2)
        assert third.recv(1) == b""
    for s in idle:
        s.close()
    wait_until(lambda: _served(server))


def _served(server) -> bool:
    try:
        return post(server, review("u-3"), timeout=2)[0] == 200
    except OSError:
        return False


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_an_empty_audience_is_refused_at_start(capsys):
    # A projected token without an audience is one for the API server: never inject that.
    with pytest.raises(SystemExit):
        webhook_cli.parse_args(["--tls-cert", "c", "--tls-key", "k", "--audience", ""])
    assert "--audience: must not be empty" in capsys.readouterr().err


def test_sigterm_stops_the_process_at_once_and_cleanly(tmp_path):
    """The kubelet stops a pod with SIGTERM; as a container's PID 1 the webhook gets no
    default action for it, so without its own handler every rollout would wait out the
    grace period. A process stopped by the signal's default action exits -15, not 0."""
    import subprocess
    import sys
    from agent_process import free_port
    pki = kube.make_pki(tmp_path / "pki")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiamfast", "webhook",
                             f"--tls-cert={pki['cert']}", f"--tls-key={pki['key']}",
                             f"--listen=127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
                time.sleep(0.05)
        started = time.monotonic()
        proc.terminate()
        assert proc.wait(5) == 0, proc.stdout.read()
        assert time.monotonic() - started < 3
        assert "the injection webhook stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
