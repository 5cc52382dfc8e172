"""Requests that wait for the control process: unknown pods, pending credentials (L7).

A worker never sleeps or polls: it tells the control process what it needs over the
channel and re-checks its waiters when a b"W" arrives, up to the wait budget, then 503.
Here the test is the control process: it reads the worker's messages and writes the table.
"""

from __future__ import annotations

import json
import socket
import time

from kiamfast import channel, table
from kiamfast.server import metrics

from server_support import Background, Client, build, wait_for_waiters

LIST = "/latest/meta-data/iam/security-credentials/"


def test_l7_unknown_ip_before_sync_waits_and_ends_in_503(make_server, pods):
    pods.ready(synced=False, ready=False)
    server = make_server()
    bg = Background(server, LIST, source="127.0.0.33")
    wait_for_waiters(server)
    r = bg.join()
    assert r.status == 503
    assert bg.elapsed >= 0.3  # it waited for the budget (0.35 s) before giving up
    assert server.waiting() == 0
    assert server.counters()[metrics.WAIT_TIMEOUTS] == 1


def test_l7_unknown_ip_known_a_moment_later_gets_its_role(make_server, pods):
    pods.ready(pending_pods=1)  # a pod on this node still waits for its IP
    server = make_server()
    bg = Background(server, LIST, source="127.0.0.34")
    wait_for_waiters(server)
    pods.add("127.0.0.34", "late-role")
    pods.ready(pending_pods=0)
    server.wake()
    r = bg.join()
    assert (r.status, r.body) == (200, b"late-role")


def test_pending_credentials_ask_for_the_slot_and_are_served_when_written(make_server, pods):
    slot = pods.add("127.0.0.1", "slow-role", state=table.CRED_PENDING)
    server = make_server()
    bg = Background(server, LIST + "slow-role")
    assert (channel.WANT_CREDENTIALS, slot) in server.messages()
    pods.role_slot("slow-role", access_key="ASIAFRESH")
    server.wake()
    r = bg.join()
    assert r.status == 200
    assert json.loads(r.body)["AccessKeyId"] == "ASIAFRESH"


def test_pending_credentials_never_written_end_in_503(make_server, pods):
    pods.add("127.0.0.1", "slow-role", state=table.CRED_PENDING)
    server = make_server()
    r = server.get(LIST)
    assert r.status == 503
    assert "not available yet" in r.text


def test_sync_completing_answers_waiters_at_once(make_server, pods):
    pods.ready(synced=False)
    server = make_server(wait_budget=3.0)
    bg = Background(server, LIST, source="127.0.0.35")
    wait_for_waiters(server)
    pods.ready(synced=True)  # the pod really is unknown
    server.wake()
    r = bg.join()
    assert r.status == 404
    assert bg.elapsed < 3.0  # answered on the wake-up, not at the end of the budget


def test_one_wake_answers_every_waiter(make_server, pods):
    slot = pods.role_slot("shared-role", state=table.CRED_PENDING)
    for i in range(2, 8):
        pods.t.claim_ip(f"127.0.0.{i}", f"pod-{i}", table.POD_ROLE, slot)
    server = make_server(wait_budget=3.0)
    bgs = [Background(server, LIST, source=f"127.0.0.{i}") for i in range(2, 8)]
    deadline = time.monotonic() + 5
    while server.waiting() < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    pods.role_slot("shared-role")
    server.wake()
    for bg in bgs:
        assert bg.join().body == b"shared-role"


def test_a_client_that_leaves_cancels_its_wait(make_server, pods):
    pods.add("127.0.0.1", "slow-role", state=table.CRED_PENDING)
    server = make_server(wait_budget=3.0)
    c = Client(server.port)
    c.send(build("GET", LIST))
    deadline = time.monotonic() + 5
    while server.waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.waiting() == 1
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    c.close()
    deadline = time.monotonic() + 5
    while server.waiting() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.waiting() == 0


def test_pipelined_answers_keep_their_order_behind_a_wait(make_server, pods):
    pods.add("127.0.0.1", "slow-role", state=table.CRED_PENDING)
    server = make_server(wait_budget=3.0)
    with Client(server.port) as c:
        c.send(build("GET", LIST) +
               build("PUT", "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
               + build("GET", "/healthz"))
        c.sock.settimeout(0.3)
        try:
            early = c.sock.recv(65536)
        except socket.timeout:
            early = b""
        assert early == b""  # the token answer must not overtake the waiting listing
        c.sock.settimeout(5)
        pods.role_slot("slow-role")
        server.wake()
        listing, token, health = c.read(3)
    assert (listing.status, listing.body) == (200, b"slow-role")
    assert token.status == 200 and len(token.body) == 44
    assert health.status == 500  # no health blob published in this test


def test_without_a_channel_waits_end_at_the_budget(make_server, pods):
    pods.ready(synced=False)
    server = make_server(with_channel=False)
    assert server.get(LIST, source="127.0.0.36").status == 503


def test_an_unknown_pod_that_turns_out_pending_asks_for_its_slot_too(make_server, pods):
    pods.ready(synced=False)
    server = make_server(wait_budget=3.0)
    bg = Background(server, LIST, source="127.0.0.37")
    wait_for_waiters(server)
    slot = pods.add("127.0.0.37", "new-role", state=table.CRED_PENDING)  # found, not fetched
    server.wake()
    assert (channel.WANT_CREDENTIALS, slot) in server.messages()
    server.wake()  # another table change: the worker does not ask again
    assert server.messages(timeout=0.3) == []
    pods.role_slot("new-role")
    pods.ready(synced=True)
    server.wake()
    assert bg.join().body == b"new-role"


def test_a_long_pipeline_of_waiting_requests_is_answered_in_order(make_server, pods):
    """More waiting requests than the queue cap: the worker stops reading, then resumes."""
    pods.add("127.0.0.1", "slow-role", state=table.CRED_PENDING)
    server = make_server(wait_budget=3.0, max_pipeline=4)
    paths = [LIST, "/healthz", LIST + "slow-role", "/readyz"] * 200  # ~50 KB at once
    with Client(server.port) as c:
        c.send(b"".join(build("GET", p) for p in paths))
        deadline = time.monotonic() + 5
        while server.waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        # parsing stopped one slice past the cap, far from all 400 waiting requests
        assert server.waiting() < 100
        pods.role_slot("slow-role")
        server.wake()
        got = c.read(len(paths))
    assert len(got) == len(paths)
    assert [r.status for r in got] == [200, 500, 200, 200] * 200
    assert got[0].body == b"slow-role"


# ---- runtime mode: only a runtime poll begun after the connection says who is asking -------

def test_runtime_mode_a_new_connection_asks_for_a_poll_begun_after_it(make_server, pods):
    pods.t.set_status(synced=True, ready=True, runtime_mode=True)
    pods.t.set_verified(time.monotonic_ns())           # a poll from before the connection
    pods.add("127.0.0.40", "early-role")               # (the table already names a pod)
    server = make_server(wait_budget=3.0)
    before = time.monotonic_ns()
    bg = Background(server, LIST, source="127.0.0.40")
    kind, accepted = server.messages()[0]
    assert kind == channel.NEED_RUNTIME and accepted >= before
    assert bg.result is None                           # not answered from the old poll
    pods.t.set_verified(accepted)                      # the control process polled: it is hers
    server.wake()
    assert (bg.join().status, bg.result.body) == (200, b"early-role")


def test_runtime_mode_a_poll_that_shows_nobody_is_404_at_once(make_server, pods):
    pods.t.set_status(synced=False, runtime_mode=True)  # the API watch does not matter here
    server = make_server(wait_budget=3.0)
    bg = Background(server, LIST, source="127.0.0.41")
    kind, accepted = server.messages()[0]
    pods.t.set_verified(accepted + 1)
    server.wake()
    r = bg.join()
    assert r.status == 404 and bg.elapsed < 2.0


def test_runtime_mode_without_a_fresh_poll_ends_in_503_never_the_old_owner(make_server, pods):
    pods.t.set_status(synced=True, runtime_mode=True)
    pods.t.set_verified(time.monotonic_ns())
    pods.add("127.0.0.42", "previous-owners-role")      # what the last poll said
    server = make_server()
    r = server.get(LIST, source="127.0.0.42")
    assert r.status == 503


def test_runtime_mode_a_kept_alive_connection_needs_one_poll_only(make_server, pods):
    pods.t.set_status(synced=True, runtime_mode=True)
    pods.add("127.0.0.43", "kept-role")
    server = make_server(wait_budget=3.0)
    with Client(server.port, source="127.0.0.43") as c:
        c.send(build("GET", LIST))
        kind, accepted = server.messages()[0]
        pods.t.set_verified(accepted)
        server.wake()
        assert c.read(1)[0].body == b"kept-role"
        for _ in range(3):                             # later requests: no new poll needed
            c.send(build("GET", LIST))
            assert c.read(1)[0].body == b"kept-role"
    assert server.messages(timeout=0.2) == []


def test_undecided_owner_waits_then_gets_its_decision(make_server, pods):
    pods.ready()
    pods.t.claim_ip("127.0.0.44", "uid-44", table.POD_UNDECIDED)
    server = make_server(wait_budget=3.0)
    bg = Background(server, LIST, source="127.0.0.44")
    wait_for_waiters(server)
    pods.add("127.0.0.44", "decided-role", uid="uid-44")
    server.wake()
    assert bg.join().body == b"decided-role"


def test_runtime_mode_a_failed_attempt_after_the_connection_answers_from_the_fallback(
        make_server, pods):
    """The runtime cannot be asked: an attempt begun after the connection failed, so the
    control process's fallback (the last view, the API for the rest) answers it."""
    pods.t.set_status(synced=True, runtime_mode=True)
    pods.add("127.0.0.45", "fallback-role")
    server = make_server(wait_budget=3.0)
    bg = Background(server, LIST, source="127.0.0.45")
    kind, accepted = server.messages()[0]
    assert kind == channel.NEED_RUNTIME
    pods.t.set_failed(accepted + 1)
    server.wake()
    assert (bg.join().status, bg.result.body) == (200, b"fallback-role")
    # An unknown address after a failed attempt: the API's caution (pods still waiting for
    # their addresses: wait), not the runtime's certainty.
    pods.t.set_status(pending_pods=1)
    r = Background(server, LIST, source="127.0.0.46")
    kind, accepted = server.messages()[0]
    pods.t.set_failed(accepted + 1)
    server.wake()
    wait_for_waiters(server)
    pods.t.set_status(pending_pods=0)
    server.wake()
    assert r.join().status == 404
