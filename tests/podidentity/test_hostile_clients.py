"""Hostile and broken clients of the container-credentials listener: none of them takes the
path away from another pod.

The whole agent against the session's real kube-apiserver (as test_container_credentials.py),
its clients on loopback source addresses 127.x.y.z, each standing for a pod's address.  What
a user checks: every bad request gets its status (400, 403, 431), never credentials; a pod
holding no connection is served while others hoard every connection place, reconnecting as
fast as they are closed, or hold 10,000 idle connections from one address or from 200; and
after each, a good pod is answered at once from its own address and from the bad one's.
"""
from __future__ import annotations

import asyncio
import json
import resource
import secrets
import socket
import time

import pytest
from agent_process import http as agent_http
from idle_clients import hoard, open_many
from test_container_credentials import Node
from token_clients import pipelined

from kiamfast.container_credentials import limits
from kiamfast.container_credentials import server as srv

pytestmark = pytest.mark.kube_apiserver

CAP_ADDRESSES = limits.MAX_CONNECTIONS // limits.MAX_CONNECTIONS_PER_ADDRESS   # 32 fill every place


def raise_fd_limit(want: int) -> None:
    """This process opens the flood's client ends (and the agent, its child, inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {want}: raise it for the test run")
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@pytest.fixture(scope="module")
def node(cluster, peers, tmp_path_factory):
    raise_fd_limit(12000)
    n = Node(cluster, peers, tmp_path_factory.mktemp("hostile"),
             lambda prefix: f"{prefix}-{secrets.token_hex(3)}")
    uid = n.pod("steady", role="role-a")
    n.steady = n.token("steady", uid)
    status, body = n.answered(n.steady)
    assert status == 200, body
    yield n
    n.agent.stop()


@pytest.fixture(autouse=True)
def own_address(node):
    node.next_source()


def metric(node: Node, name: str) -> float:
    """The agent's /metrics value of ``name`` (published every 2 s)."""
    status, text = agent_http(node.agent.port, "GET /metrics")
    assert status == 200
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def settled_metric(node: Node, name: str) -> float:
    """``name`` once what came before has been published."""
    time.sleep(2.5)
    return metric(node, name)


def wait_metric(node: Node, name: str, ready, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while not ready(value := metric(node, name)):
        assert time.monotonic() < deadline, f"{name} = {value}"
        time.sleep(0.2)
    return value


def assert_others_unaffected(node: Node, bad_source: str) -> None:
    """A good pod is answered from its own address and from the one that misbehaved."""
    for source in (node.source, bad_source):
        status, body = node.ask(node.steady, source=source)
        assert status == 200 and body["AccessKeyId"], (source, body)


def fresh_source(node: Node) -> str:
    node.next_source()
    return node.source


# ---- bad requests ------------------------------------------------------------------------------

def raw(node: Node, data: bytes, source: str) -> bytes:
    """Send ``data`` (written while the answer is read) and return what comes back."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=10,
                                  source_address=(source, 0)) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass                          # refused before the whole of it was read
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    assert b"AccessKeyId" not in answer
    return int(answer.split()[1])


def get(token: str, *headers: str) -> bytes:
    lines = ["GET /v1/credentials HTTP/1.1", "Host: 169.254.170.23", *headers,
             f"Authorization: {token}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def test_header_floods_and_long_lines_get_431_or_their_answer(node):
    bad = fresh_source(node)
    many = [f"X-Flood-{i}: {'v' * 20}" for i in range(1000)]            # about 30 KiB
    assert status_of(raw(node, get(node.steady, *many), bad)) == 431
    long_line = ["X-Long: " + "v" * 30000]
    assert status_of(raw(node, get(node.steady, *long_line), bad)) == 431
    # Many headers within the bound are no fault: the pod is answered.
    within = [f"X-Many-{i}: v" for i in range(300)]
    answer = raw(node, get(node.steady, *within), bad)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"AccessKeyId" in answer, answer[:300]
    assert_others_unaffected(node, bad)


def test_a_token_of_a_mebibyte_gets_431_unread(node):
    bad = fresh_source(node)
    reviews = settled_metric(node, 'kiamfast_token_reviews_total{kind="reviews"}')
    assert status_of(raw(node, get("a" * (1 << 20)), bad)) == 431
    jwt_like = node.steady.split(".")[0] + "." + "A" * (1 << 20) + ".sig"
    assert status_of(raw(node, get(jwt_like), bad)) == 431
    assert settled_metric(node, 'kiamfast_token_reviews_total{kind="reviews"}') == reviews
    assert_others_unaffected(node, bad)


def test_tokens_with_nul_cr_or_lf_are_400_without_a_review(node):
    bad = fresh_source(node)
    reviews = settled_metric(node, 'kiamfast_token_reviews_total{kind="reviews"}')
    head, payload, sig = node.steady.split(".")
    for token in (f"{head}.{payload}\0.{sig}", f"{head}.{payload[:20]}\n{payload[20:]}.{sig}",
                  f"{head}.{payload}\r.{sig}", f"{head}\r\nX-Injected: 1\r\n.{payload}.{sig}"):
        answer = raw(node, get(token), bad)
        assert status_of(answer) == 400, (token[:40], answer)
        assert b'"BadRequest"' in answer or b'"InvalidToken"' in answer, answer
    assert settled_metric(node, 'kiamfast_token_reviews_total{kind="reviews"}') == reviews
    assert_others_unaffected(node, bad)


def test_a_token_of_another_audience_is_400(node):
    bad = fresh_source(node)
    uid = node.pod("other-audience", role="role-a")
    token = node.token("other-audience", uid, audience="sts.amazonaws.com")
    status, body = node.ask(token, source=bad)
    assert (status, body["Code"]) == (400, "InvalidToken") and "audience" in body["Message"]
    assert_others_unaffected(node, bad)


def test_a_deleted_pods_tokens_replayed_from_its_address_never_get_credentials(node):
    """One token it used while alive, one it never used: after the deletion both are
    refused (403 once the watch has it; a review in between is 503, the API server's
    "invalidated" being also what a failed lookup says), never answered with credentials."""
    pod_address = fresh_source(node)
    uid = node.pod("doomed-replay", role="role-a")
    used = node.token("doomed-replay", uid)
    unused = node.token("doomed-replay", uid, seconds=700)
    status, body = node.answered(used)
    assert status == 200, body
    node.admin.delete_pod(node.ns, "doomed-replay")
    deadline = time.monotonic() + 15
    final = {}
    while len(final) < 2:
        assert time.monotonic() < deadline, final
        for name, token in (("used", used), ("unused", unused)):
            status, body = node.ask(token, source=pod_address)
            assert status in (200, 403, 503) and (status != 200 or name == "used"), body
            if status == 403:
                final[name] = body
        time.sleep(0.05)
    for body in final.values():
        assert body["Code"] == "AccessDenied" and "not on" in body["Message"], body
    for _ in range(5):                     # and stays so
        for token in (used, unused):
            assert node.ask(token, source=pod_address)[0] == 403
    assert_others_unaffected(node, pod_address)


# ---- clients that send more than they read ---------------------------------------------------

def served_pods(node: Node, prefix: str, n: int) -> list[tuple[str, str]]:
    """``n`` pods of role-a, each token reviewed once (from an address of its own): (token,
    the AccessKeyId it is answered with)."""
    out = []
    for i in range(n):
        uid = node.pod(f"{prefix}-{i}", role="role-a")
        token = node.token(f"{prefix}-{i}", uid)
        node.next_source()
        status, body = node.answered(token)
        assert status == 200, body
        out.append((token, body["AccessKeyId"]))
    return out


def test_a_pipelining_client_gets_every_answer_in_order(node):
    pods = served_pods(node, "piped", 2) + [(node.steady, node.ask(node.steady)[1]["AccessKeyId"])]
    order = [pods[i % len(pods)] for i in range(30)]
    with socket.create_connection(("127.0.0.1", node.port), timeout=10,
                                  source_address=(fresh_source(node), 0)) as s:
        s.sendall(pipelined([token for token, _ in order]))
        reader = s.makefile("rb")
        for _, key in order:
            assert reader.readline().startswith(b"HTTP/1.1 200 ")
            length = 0
            while (line := reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            assert json.loads(reader.read(length))["AccessKeyId"] == key


def test_a_client_that_pipelines_and_never_reads_is_let_go(node):
    """Requests sent without reading a byte (a small receive buffer), until the agent stops
    reading them: its answers wait in the socket's buffers.  The connection, busy for ever
    before, is closed once an answer has waited `WRITE_TIMEOUT` to be read; the agent holds
    no place for it, and others are served meanwhile."""
    tokens = [token for token, _ in served_pods(node, "unread", 60)]
    bad = fresh_source(node)
    held = settled_metric(node, "kiamfast_container_credentials_connections")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.bind((bad, 0))
    client.connect(("127.0.0.1", node.port))
    client.setblocking(False)
    data = pipelined(tokens)
    try:
        last_sent, left = time.monotonic(), memoryview(data)
        while time.monotonic() - last_sent < 1.0:
            try:
                left = left[client.send(left):] or memoryview(data)   # whole requests only
                last_sent = time.monotonic()
            except BlockingIOError:
                time.sleep(0.05)
            except ConnectionError:
                break                                   # let go already
        stuck = time.monotonic()
        status, body = node.ask(node.steady, source=fresh_source(node))   # another pod
        assert status == 200, body
        wait_metric(node, "kiamfast_container_credentials_connections", lambda v: v <= held,
                    timeout=srv.WRITE_TIMEOUT + 10)
        assert time.monotonic() - stuck < srv.WRITE_TIMEOUT + 10
    finally:
        client.close()
    time.sleep(limits.COOL_DOWN)         # its 429s, past the pods' budgets, may have cooled it
    assert_others_unaffected(node, bad)


# ---- connections -------------------------------------------------------------------------------

def ask_in_thread(node: Node, source: str) -> tuple[int, dict]:
    return node.ask(node.steady, source=source)


def test_a_pod_holding_no_connection_is_served_while_hoarders_keep_every_place(node):
    """32 addresses x 16 connections fill the listener's 512 places and reconnect as fast
    as they are closed (by an eviction, or the 10 s idle timeout); pods holding none are
    still served, in place of the longest idle connection of an address holding the most."""
    hoarders = [fresh_source(node) for _ in range(CAP_ADDRESSES)]
    evicted = settled_metric(node, 'kiamfast_container_credentials_connections_closed_total'
                                   '{kind="evicted"}')

    async def scenario() -> list[tuple[int, dict]]:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(hoard(node.port, h, limits.MAX_CONNECTIONS_PER_ADDRESS,
                                           stop)) for h in hoarders]
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, wait_metric, node,
                                       "kiamfast_container_credentials_connections",
                                       lambda v: v >= limits.MAX_CONNECTIONS)
            answers = []
            for _ in range(10):                   # ten pods, each from an address of its own
                answers.append(await loop.run_in_executor(None, ask_in_thread, node,
                                                          fresh_source(node)))
            return answers
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(scenario())
    assert [a[0] for a in answers] == [200] * 10, answers
    assert all(a[1]["AccessKeyId"] for a in answers)
    # Most got in by an eviction (one that came while a hoarder was reconnecting took the
    # free place).
    wait_metric(node, 'kiamfast_container_credentials_connections_closed_total'
                      '{kind="evicted"}', lambda v: v >= evicted + 1)
    assert_others_unaffected(node, hoarders[0])


@pytest.mark.parametrize("addresses", [1, 200])
def test_ten_thousand_idle_connections_take_no_pods_path(node, addresses):
    sources = [fresh_source(node) for _ in range(addresses)]

    async def scenario() -> tuple[int, list[tuple[int, dict]], float]:
        opened = await open_many(node.port, sources, 10000 // addresses)
        loop = asyncio.get_running_loop()
        try:
            held = await loop.run_in_executor(None, wait_metric, node,
                                              "kiamfast_container_credentials_connections",
                                              lambda v: v <= limits.MAX_CONNECTIONS)
            answers = [await loop.run_in_executor(None, ask_in_thread, node,
                                                  fresh_source(node)) for _ in range(5)]
            return len(opened), answers, held
        finally:
            for writer in opened:
                writer.close()

    opened, answers, held = asyncio.run(scenario())
    assert opened >= 9000, opened          # the flood did connect
    assert held <= min(limits.MAX_CONNECTIONS, addresses * limits.MAX_CONNECTIONS_PER_ADDRESS) + 1
    assert [a[0] for a in answers] == [200] * 5, answers
    assert_others_unaffected(node, sources[0])
    # Nothing is left holding a place once the flood's clients are gone.
    wait_metric(node, "kiamfast_container_credentials_connections", lambda v: v <= 1)
