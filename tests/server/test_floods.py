"""Floods one hostile pod can aim at a worker (issue 20: items 5b, 6b and 9).

Each test is the flood and what the other pods, the node's metadata service and the worker
must still get: a new pod gets in when other addresses hold every connection place, the
passthrough is bounded per address, cheap answers stay cheap (a scrape flood renders the
metrics once, a denied flood reads the denials once), and waiting requests cost the control
process one runtime demand and the worker one look-up when they can be answered.
"""

from __future__ import annotations

import collections
import json
import time

import pytest

from kiamfast import channel, table
from kiamfast.server import metrics
from kiamfast.server.upstream import PassthroughLimit

from server_support import (Background, Client, build, closed_by_server, open_idle, until,
                            wait_for_waiters)

LIST = "/latest/meta-data/iam/security-credentials/"
PASS = "/latest/meta-data/instance-id"


class CountingTable(table.Table):
    """The worker's table, counting the reads a flood could multiply."""

    calls: collections.Counter = collections.Counter()

    def read_aux(self, index):
        CountingTable.calls["read_aux", index] += 1
        return super().read_aux(index)

    def counters_sum(self):
        CountingTable.calls["counters_sum"] += 1
        return super().counters_sum()


def counting_table() -> type[CountingTable]:
    CountingTable.calls = collections.Counter()
    return CountingTable


# ---- connection places: hoarding addresses cannot keep a new pod out ------------------------

def test_a_new_pod_is_served_when_other_addresses_hold_every_connection_place(make_server, pods):
    pods.add("127.0.0.2", "newcomer-role")
    server = make_server(max_connections=16, max_connections_per_client=4)
    hoards = [open_idle(server.port, f"127.0.0.{i}", 4) for i in range(61, 65)]
    try:
        until(lambda: server.call(lambda: len(server.core.conns)) == 16, what="16 connections")
        with Client(server.port, source="127.0.0.2") as c:
            r = c.request(build("GET", LIST))
            assert (r.status, r.body) == (200, b"newcomer-role")
            # one hoarded connection made room; the cap still holds
            assert server.call(lambda: len(server.core.conns)) == 16
        closed = [s for hoard in hoards for s in hoard if closed_by_server(s, 0.05)]
        assert len(closed) == 1
        assert server.counters()[metrics.CONNECTIONS_EVICTED] == 1
    finally:
        for s in (s for hoard in hoards for s in hoard):
            s.close()


def test_at_the_cap_nobody_is_evicted_for_an_address_holding_as_many(make_server, pods):
    """Evicting only ever takes from an address holding two more than the newcomer's."""
    pods.add("127.0.0.2", "role")
    server = make_server(max_connections=4, max_connections_per_client=4)
    held = [open_idle(server.port, f"127.0.0.{i}", 1)[0] for i in range(71, 75)]
    try:
        until(lambda: server.call(lambda: len(server.core.conns)) == 4, what="4 connections")
        extra = open_idle(server.port, "127.0.0.2", 1)[0]
        assert closed_by_server(extra)
        assert not any(closed_by_server(s, 0.05) for s in held)
        counters = server.counters()
        assert counters[metrics.CONNECTIONS_EVICTED] == 0
        assert counters[metrics.CONNECTIONS_REJECTED] == 1
    finally:
        for s in held:
            s.close()


# ---- passthrough: a bounded share of the node's metadata service per address ----------------

def test_passthrough_requests_in_flight_are_bounded_per_address(make_server, pods, imds):
    imds.delay = 0.3
    server = make_server(upstream_timeout=5.0, passthrough_concurrency=2)
    with Client(server.port, source="127.0.0.50") as c:
        c.send(b"".join(build("GET", PASS) for _ in range(6)))
        got = c.read(6)
    assert [r.status for r in got] == [200, 200, 429, 429, 429, 429]
    assert got[2].header("Retry-After") == "1"
    assert sum(q.method == "GET" for q in imds.requests) == 2
    assert server.get(PASS, source="127.0.0.51").status == 200
    assert server.counters()[metrics.PASSTHROUGH_LIMITED] == 4


def test_passthrough_rate_is_bounded_per_address(make_server, pods, imds):
    server = make_server(passthrough_rate=1.0, passthrough_burst=3)
    started = time.monotonic()
    statuses = [server.get(PASS, source="127.0.0.52").status for _ in range(10)]
    elapsed = time.monotonic() - started
    assert statuses[:3] == [200, 200, 200]
    assert 429 in statuses
    assert statuses.count(200) <= 3 + int(elapsed) + 1     # the burst, then 1/s
    assert sum(q.method == "GET" for q in imds.requests) == statuses.count(200)
    assert server.get(PASS, source="127.0.0.53").status == 200   # another pod's own share


def test_a_passthrough_cut_short_by_its_client_gives_its_place_back(make_server, pods, imds):
    imds.delay = 0.5
    server = make_server(upstream_timeout=5.0, passthrough_concurrency=1)
    c = Client(server.port, source="127.0.0.54")
    c.send(build("GET", PASS))
    until(lambda: any(q.method == "PUT" for q in imds.requests), what="the upstream asked")
    c.close()
    imds.delay = 0.0
    until(lambda: server.get(PASS, source="127.0.0.54").status == 200, what="a place again")


def test_passthrough_limit_refills_and_forgets_idle_addresses():
    now = [0.0]
    limit = PassthroughLimit(rate=2.0, burst=2, concurrency=1, clock=lambda: now[0])
    assert limit.acquire(b"a")
    assert not limit.acquire(b"a")            # one in flight
    limit.release(b"a")
    assert limit.acquire(b"a")                # the burst's second token
    limit.release(b"a")
    assert not limit.acquire(b"a")            # bucket empty
    now[0] += 0.5                             # 2/s: one token back
    assert limit.acquire(b"a")
    limit.release(b"a")
    assert limit.acquire(b"b")                # its own bucket
    limit.release(b"b")
    now[0] += 10.0
    limit._prune(now[0])
    assert limit._buckets == {} and limit._in_flight == {}


# ---- cheap floods against expensive answers -------------------------------------------------

def test_a_flood_of_scrapes_renders_the_metrics_once_a_second(make_server, pods, writer):
    writer.write_aux(table.AUX_METRICS, b"kube2iam_info 1\n")
    server = make_server(table_cls=counting_table())
    started = time.monotonic()
    with Client(server.port) as c:
        c.send(b"".join(build("GET", "/metrics") for _ in range(50)))
        got = c.read(50)
    elapsed = time.monotonic() - started
    assert len(got) == 50 and all(r.status == 200 for r in got)
    assert all(r.body.startswith(b"kube2iam_info 1\n") for r in got)
    renders = CountingTable.calls["counters_sum"]
    assert 1 <= renders <= 1 + int(elapsed)
    assert CountingTable.calls["read_aux", table.AUX_METRICS] == renders


@pytest.mark.parametrize("path,aux,blob", [
    ("/healthz", table.AUX_HEALTH, b'{"hostIP":"10.0.0.5","instanceId":"i-0abc"}'),
    ("/debug/store", table.AUX_DEBUG_STORE, b'{"rolesByIP":{"10.0.0.9":"r"}}'),
])
def test_a_flood_of_operational_requests_reads_their_blob_once_per_change(
        make_server, pods, writer, path, aux, blob):
    writer.write_aux(aux, blob)
    server = make_server(table_cls=counting_table(), debug=True)
    with Client(server.port) as c:
        c.send(b"".join(build("GET", path) for _ in range(50)))
        got = c.read(50)
    assert [(r.status, r.body.rstrip(b"\n")) for r in got] == [(200, blob)] * 50
    assert CountingTable.calls["read_aux", aux] == 1
    writer.write_aux(aux, blob.replace(b"10.0.0", b"10.9.9"))    # the next one is seen
    assert b"10.9.9" in server.get(path).body


def test_cached_metrics_catch_up_with_new_requests(server, pods):
    pods.add("127.0.0.1", "app-role")
    line = 'kiamfast_http_requests_total{handler="securityCredentialsHandler",code="200"} 1'
    assert line not in server.get("/metrics").text
    assert server.get(LIST).status == 200
    until(lambda: line in server.get("/metrics").text, what="the new count in /metrics")


def test_with_its_own_metrics_port_the_app_port_serves_no_metrics(make_server, pods):
    server = make_server(metrics_port=9)   # any port != app_port: a second listener
    assert server.get("/metrics").status == 404
    with Client(server.metrics_port) as c:
        assert c.request(build("GET", "/metrics")).status == 200


def test_denied_answers_read_the_denials_once_per_table_change(make_server, pods, writer):
    arn = "arn:aws:iam::123456789012:role/forbidden"
    writer.write_aux(table.AUX_DENIALS, json.dumps({"uid-127.0.0.7": [arn, "team"]}).encode())
    pods.add("127.0.0.7", None, pod_state=table.POD_DENIED)
    server = make_server(table_cls=counting_table())
    with Client(server.port, source="127.0.0.7") as c:
        c.send(b"".join(build("GET", LIST) for _ in range(50)))
        got = c.read(50)
    expected = (f"role requested {arn} not valid for namespace of pod at 127.0.0.7 "
                f"with namespace team\n")
    assert [(r.status, r.text) for r in got] == [(404, expected)] * 50
    assert CountingTable.calls["read_aux", table.AUX_DENIALS] == 1
    # what the control process publishes next is what the next answer says
    writer.write_aux(table.AUX_DENIALS, json.dumps({"uid-127.0.0.7": [arn, "other"]}).encode())
    assert server.get(LIST, source="127.0.0.7").text.endswith("with namespace other\n")


# ---- waiting requests: one runtime demand, look-ups only when they can be answered ----------

def runtime_mode(pods) -> None:
    pods.t.set_status(synced=True, ready=True, runtime_mode=True)


def test_fresh_connections_share_one_outstanding_runtime_demand(make_server, pods):
    runtime_mode(pods)
    for i in range(1, 11):
        pods.add(f"127.0.1.{i}", "role-a")
    server = make_server(wait_budget=3.0)
    first = Background(server, LIST, source="127.0.1.1")
    kind, demanded = server.messages()[0]
    assert kind == channel.NEED_RUNTIME
    others = [Background(server, LIST, source=f"127.0.1.{i}") for i in range(2, 11)]
    wait_for_waiters(server, 10)
    assert server.messages(timeout=0.2) == []      # the first demand covers them for now
    pods.t.set_verified(demanded)                  # a poll that answers the first one only
    server.wake()
    assert first.join().body == b"role-a"
    (kind, newest), = server.messages()            # one demand, for the newest waiting
    assert kind == channel.NEED_RUNTIME and newest > demanded
    pods.t.set_verified(newest)
    server.wake()
    assert [bg.join().body for bg in others] == [b"role-a"] * 9
    assert server.messages(timeout=0.2) == []


def test_a_table_change_looks_up_only_the_waiters_it_can_answer(make_server, pods):
    runtime_mode(pods)
    pods.add("127.0.1.20", "slow-role", state=table.CRED_PENDING)   # waits for credentials
    for i in range(21, 26):
        pods.add(f"127.0.1.{i}", "role-b")                           # wait for a poll
    server = make_server(wait_budget=5.0)

    def rechecks() -> int:
        return server.counters()[metrics.WAIT_RECHECKS]

    probe = Background(server, LIST + "slow-role", source="127.0.1.20")
    _, accepted = server.messages()[0]
    pods.t.set_verified(accepted)
    server.wake()
    until(lambda: rechecks() == 1, what="the probe looked up again")
    polls = [Background(server, LIST, source=f"127.0.1.{i}") for i in range(21, 26)]
    wait_for_waiters(server, 6)
    for n in range(2, 5):                          # changes no poll-waiter can use
        pods.ready()
        server.wake()
        until(lambda: rechecks() >= n, what="the probe looked up again")
        assert rechecks() == n
    pods.t.set_verified(time.monotonic_ns())       # a poll begun after all of them
    server.wake()
    assert [bg.join().body for bg in polls] == [b"role-b"] * 5
    assert rechecks() == 4 + 1 + 5
    pods.role_slot("slow-role")
    server.wake()
    assert probe.join().status == 200


def test_a_waiter_no_change_can_answer_still_ends_at_the_budget(make_server, pods):
    runtime_mode(pods)
    pods.add("127.0.1.30", "role-c")
    server = make_server(wait_budget=0.5)
    bg = Background(server, LIST, source="127.0.1.30")
    wait_for_waiters(server)
    for _ in range(3):
        pods.ready()
        server.wake()
    r = bg.join()
    assert r.status == 503 and bg.elapsed >= 0.45
    assert server.waiting() == 0
    assert server.counters()[metrics.WAIT_TIMEOUTS] == 1
