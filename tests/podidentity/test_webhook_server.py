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

API = "127.0.0.2"          # the API server's address; a pod's is 127.0.0.1
SETTINGS = {"role_key": "iam.amazonaws.com/role", "audience": "kiamfast.io/container-credentials",
            "expiration": 600}


def start(tmp_path, max_connections: int = 2):
    pki = kube.make_pki(tmp_path / "pki")
    srv = webhook_server.make_server(listen=("127.0.0.1", 0), cert=str(pki["cert"]),
                                     key=str(pki["key"]), settings=SETTINGS,
                                     max_connections=max_connections)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.ca = pki["ca"]
    return srv


def stop(srv) -> None:
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def server(tmp_path):
    srv = start(tmp_path)
    yield srv
    stop(srv)


def post_full(server, body: bytes, headers: dict | None = None, timeout: float = 10.0,
              source: str = "127.0.0.1"):
    context = ssl.create_default_context(cafile=str(server.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", server.server_address[1], context=context,
                                       timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", "/mutate", body, headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def post(server, body: bytes, headers: dict | None = None, timeout: float = 10.0,
         source: str = "127.0.0.1"):
    status, _, answer = post_full(server, body, headers, timeout, source)
    return status, answer


def tls_connection(server, source: str = "127.0.0.1") -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(server.ca))
    sock = socket.create_connection(server.server_address, timeout=5,
                                    source_address=(source, 0))
    return context.wrap_socket(sock, server_hostname="127.0.0.1")


def review(uid: str, padding: int = 0) -> bytes:
    pod = {"metadata": {"annotations": {"x": "y" * padding}} if padding else {}, "spec": {}}
    return json.dumps({"request": {"uid": uid, "operation": "CREATE", "kind": {"kind": "Pod"},
                                   "object": pod}}).encode()


def test_a_review_over_tls_is_answered(server):
    status, body = post(server, review("u-1"))
    assert status == 200
    assert json.loads(body)["response"] == {"uid": "u-1", "allowed": True}


def test_a_body_over_the_bound_is_refused_by_its_length(server):
    status, _ = post(server, b"", {"Content-Length": str(webhook_server.MAX_REVIEW_BYTES + 1)})
    assert status == 413


def test_a_body_over_the_bound_sent_whole_gets_its_413_not_a_reset(server):
    # As the API server sends it: all at once.  Closing with its bytes unread would reset
    # the connection under the answer; the webhook drops them as they come instead.
    status, body = post(server, b" " * (webhook_server.MAX_REVIEW_BYTES + 1))
    assert status == 413 and body == b"review too large\n"
    assert post(server, review("u-after"))[0] == 200


def test_a_bound_fits_what_the_api_server_sends_for_the_largest_pod_etcd_stores():
    # Measured on the real ones: a pod of 1.48 MiB of strings is stored, its review is
    # 2 KiB larger; the API server refuses request bodies over 3 MiB, etcd values over 1.5.
    assert 1.5 * 2**20 + 64 * 2**10 < webhook_server.MAX_REVIEW_BYTES < 3 * 2**20


@pytest.mark.parametrize("body", [b"not json", b'{"request": {"uid": "u-t", "kind"',
                                  json.dumps({"request": {
                                      "uid": "u-k", "operation": "CREATE",
                                      "kind": {"kind": "Service"}, "object": {}}}).encode()])
def test_non_json_truncated_and_other_kinds_are_admitted_unpatched(server, body):
    status, answer = post(server, body)
    assert status == 200
    response = json.loads(answer)["response"]
    assert response["allowed"] is True and "patch" not in response


def test_a_body_shorter_than_announced_is_dropped_and_others_still_served(server):
    with tls_connection(server) as conn:
        conn.sendall(b"POST /mutate HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{\"req")
    assert post(server, review("u-short"))[0] == 200


def test_a_header_flood_is_refused_with_431(server):
    flood = {f"X-Flood-{i}": "x" * 1000 for i in range(60)}     # 60 KiB, 60 headers
    status, _ = post(server, review("u-flood"), flood)
    assert status == 431
    assert post(server, review("u-after-flood"))[0] == 200


def test_a_slow_sender_is_cut_at_the_request_deadline_whatever_its_reads_do(
        server, monkeypatch):
    monkeypatch.setattr(webhook_server, "REQUEST_DEADLINE", 1.0)
    with tls_connection(server) as conn:
        started = time.monotonic()
        head = b"POST /mutate HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789"
        closed = False
        for i in range(len(head)):               # a byte every 0.2 s: no read times out
            try:
                conn.sendall(head[i:i + 1])
            except OSError:
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - started > 4:
                break
        conn.settimeout(2)
        try:
            closed = closed or conn.recv(1024) == b""
        except OSError:
            closed = True
    assert closed
    assert time.monotonic() - started < 4


def test_a_newcomer_at_the_cap_closes_the_connection_waiting_longest(server):
    # Both slots held by connections that handshook and sent nothing: the API server's
    # call is served at once, and the oldest of them is closed.
    first, second = tls_connection(server), tls_connection(server)
    with first, second:
        first.sendall(b"P")
        time.sleep(0.1)
        started = time.monotonic()
        assert post(server, review("u-newcomer"), timeout=5, source=API)[0] == 200
        assert time.monotonic() - started < webhook_server.IDLE_TIMEOUT / 2
        first.settimeout(2)
        assert first.recv(1024) == b""


def test_the_api_servers_connection_outlives_newcomers_of_an_address_holding_more(tmp_path):
    # The API server's call (127.0.0.2) begins first and is the oldest waiting; newcomers
    # of a pod (127.0.0.1) at the cap close that pod's own connections, not it.
    srv = start(tmp_path, max_connections=3)
    try:
        api = tls_connection(srv, source=API)
        body = review("u-api")
        api.sendall(f"POST /mutate HTTP/1.1\r\nContent-Length: {len(body)}\r\n".encode())
        pod = [tls_connection(srv) for _ in range(4)]    # two fill the cap, two more evict
        time.sleep(0.2)
        api.sendall(b"\r\n" + body)
        api.settimeout(5)
        answer = api.recv(65536)
        assert answer.startswith(b"HTTP/1.0 200"), answer
        for conn in [api, *pod]:
            conn.close()
    finally:
        stop(srv)


def test_many_slow_connections_never_keep_the_api_servers_call_out(server):
    senders = []
    try:
        for _ in range(20):                       # ten times the cap of this server
            try:
                conn = socket.create_connection(server.server_address, timeout=2)
            except OSError:
                continue
            conn.sendall(b"\x16")                # a TLS record begun, never finished
            senders.append(conn)
        for i in range(5):               # the API server, from an address of its own
            assert post(server, review(f"u-busy-{i}"), timeout=5, source=API)[0] == 200
    finally:
        for conn in senders:
            conn.close()


def test_bodies_over_the_budget_are_told_to_try_again_and_small_ones_still_served(
        tmp_path, monkeypatch):
    from kiamfast.webhook import limits
    monkeypatch.setattr(limits, "BODY_BUDGET", 3 * limits.SMALL_BODY)
    monkeypatch.setattr(limits, "BUDGET_WAIT", 0.2)
    srv = start(tmp_path)
    try:
        big = 2 * limits.SMALL_BODY
        with tls_connection(srv) as holder:       # announces a big body, sends none
            holder.sendall(f"POST /mutate HTTP/1.1\r\nContent-Length: {big}\r\n\r\n"
                           .encode())
            time.sleep(0.2)
            status, headers, _ = post_full(srv, review("u-big", padding=big))
            assert status == 429 and headers["Retry-After"] == "1"
            assert post(srv, review("u-small"))[0] == 200
        wait_until(lambda: post_full(srv, review("u-big2", padding=big))[0] == 200)
    finally:
        stop(srv)


def test_a_review_too_costly_to_parse_is_refused_and_the_memory_is_never_taken(
        tmp_path, monkeypatch):
    from kiamfast.webhook import limits
    monkeypatch.setattr(limits, "PARSE_BUDGET", 2 << 20)
    monkeypatch.setattr(limits, "KEEP_FOR_SMALL", 0)
    srv = start(tmp_path)
    try:
        dense = b'{"request": {"uid": "u-dense", "x": [' + b",".join([b"{}"] * 30000) + b"]}}"
        assert limits.parse_cost(dense) > 2 << 20
        status, _, body = post_full(srv, dense)
        assert status == 413 and body == b"review too large to parse\n"
        assert srv.parsed.used == 0
        assert post(srv, review("u-after-dense"))[0] == 200
    finally:
        stop(srv)


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
    from kiamfast.testing.net import free_port
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


def many_containers_review(uid: str, n: int) -> bytes:
    """An opting-in pod of ``n`` empty containers: 3 bytes a container to send, two patch
    operations each to answer."""
    pod = {"metadata": {"name": "many", "annotations": {
        "iam.amazonaws.com/role": "role-a", "kiamfast.io/container-credentials": "true"}},
        "spec": {"serviceAccountName": "app", "containers": [{}] * n}}
    return json.dumps({"request": {"uid": uid, "operation": "CREATE", "namespace": "ns",
                                   "kind": {"kind": "Pod"}, "object": pod}},
                      separators=(",", ":")).encode()


def test_a_review_whose_answer_would_not_fit_the_budget_is_admitted_unpatched_with_why(server):
    # 372 KB that parses within the budget; its patch took 330 MiB to build, 77 MiB to send.
    from kiamfast.webhook import limits
    body = many_containers_review("u-many", 124_000)
    assert server.parsed.fits(limits.parse_cost(body))
    status, answer = post(server, body, timeout=30)
    assert status == 200 and len(answer) < 1024
    response = json.loads(answer)["response"]
    assert response["uid"] == "u-many" and response["allowed"] is True
    assert "patch" not in response
    (warning,) = response["warnings"]
    assert "not injected" in warning and "124000 containers" in warning
    assert len(warning) <= 120                 # what the API server passes on whole
    assert server.parsed.used == 0
    # An ordinary pod is patched as ever, and so is one of many containers that fits.
    for uid, n in (("u-one", 1), ("u-hundred", 100)):
        status, answer = post(server, many_containers_review(uid, n))
        assert status == 200 and "patch" in json.loads(answer)["response"], uid


def test_the_api_servers_call_waiting_for_us_is_not_cut_by_pods_of_many_addresses(
        tmp_path, monkeypatch):
    """The API server (127.0.0.2) sends a large review whole, at once; its handler waits for
    the body budget (full here), the body unread in the socket.  Pods of addresses of their
    own, as many as it holds connections, fill the other slots and keep coming: each
    newcomer closes one of the pods' connections, never the API server's, which is answered
    once the budget has room (before, it counted as waiting until its body was read: the
    oldest of equals, it was the one closed)."""
    from kiamfast.webhook import limits
    monkeypatch.setattr(limits, "BUDGET_WAIT", 5.0)
    srv = start(tmp_path, max_connections=3)
    pods = []
    held = srv.bodies.total
    assert srv.bodies.reserve(held, timeout=0)       # as other large bodies would
    try:
        api = tls_connection(srv, source=API)
        body = review("u-api", padding=2 * limits.SMALL_BODY)
        api.sendall(f"POST /mutate HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n"
                    .encode() + body)
        time.sleep(0.2)
        for i in range(4):                  # two fill the cap, two more evict
            pods.append(tls_connection(srv, source=f"127.0.0.{10 + i}"))
            time.sleep(0.05)
        assert srv.connections.evicted == 2
        srv.bodies.release(held)
        held = 0
        api.settimeout(10)
        answer = b""
        while chunk := api.recv(65536):      # HTTP/1.0: the answer ends with the connection
            answer += chunk
        assert answer.startswith(b"HTTP/1.0 200"), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["response"]["uid"] == "u-api"
    finally:
        srv.bodies.release(held)
        for conn in [api, *pods]:
            conn.close()
        stop(srv)


def test_a_head_whose_body_never_comes_keeps_no_newcomer_out(tmp_path):
    srv = start(tmp_path, max_connections=2)
    try:
        stalled = []
        for i in range(2):                  # whole heads, no body: every slot protected
            conn = tls_connection(srv, source=f"127.0.0.{20 + i}")
            conn.sendall(b"POST /mutate HTTP/1.1\r\nContent-Length: 1000\r\n\r\n")
            stalled.append(conn)
        time.sleep(0.1)
        started = time.monotonic()
        assert post(srv, review("u-newcomer"), timeout=5, source=API)[0] == 200
        assert time.monotonic() - started < webhook_server.ADMIT_WAIT
        assert srv.connections.evicted >= 1
        for conn in stalled:
            conn.close()
    finally:
        stop(srv)
