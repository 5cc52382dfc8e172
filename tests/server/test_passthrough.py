"""The passthrough to the metadata service (sdk-imds.md §10 P1–P2, §6)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from kiamfast.testing.fake_imds import FakeImds
from kiamfast.testing.net import free_port

TOKEN = "X-aws-ec2-metadata-token"


@pytest.mark.parametrize("path,expected", [
    ("/latest/meta-data/placement/region", b"eu-west-1"),
    ("/latest/meta-data/placement/availability-zone/", None),
    ("/latest/meta-data/placement/availability-zone", b"eu-west-1b"),
    ("/latest/meta-data/instance-id", b"i-0fa4e1a5e0000cafe"),
    ("/2021-07-15/meta-data/instance-id", b"i-0fa4e1a5e0000cafe"),
])
def test_p1_values_come_from_upstream(server, imds, path, expected):
    r = server.get(path)
    if expected is None:
        assert r.status in (200, 404)
    else:
        assert (r.status, r.body) == (200, expected)
    assert r.header("Content-Type") == "text/plain"


def test_p1_identity_document(server, imds):
    r = server.get("/latest/dynamic/instance-identity/document")
    assert r.status == 200
    assert json.loads(r.body)["region"] == "eu-west-1"


def test_p1_upstream_sees_the_agent_token_never_the_pod_token_nor_xff(server, imds):
    pod_token = server.token()
    r = server.get("/latest/meta-data/instance-id",
                   headers={TOKEN: pod_token, "X-Forwarded-For": "6.6.6.6"})
    assert r.status == 200
    gets = [q for q in imds.requests if q.method == "GET"]
    puts = [q for q in imds.requests if q.method == "PUT"]
    assert len(gets) == 1 and len(puts) == 1
    assert gets[0].token is not None and gets[0].token != pod_token
    assert "x-forwarded-for" not in gets[0].headers
    assert "x-forwarded-for" not in puts[0].headers
    assert puts[0].headers["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
    assert gets[0].path == "/latest/meta-data/instance-id"


def test_agent_token_is_cached(server, imds):
    for _ in range(5):
        assert server.get("/latest/meta-data/instance-id").status == 200
    assert sum(q.method == "PUT" for q in imds.requests) == 1


def test_upstream_requiring_tokens_works(make_server, pods):
    with FakeImds(token_mode="required") as strict:
        server = make_server(metadata_addr=strict.addr)
        assert server.get("/latest/meta-data/instance-id").status == 200


@pytest.mark.parametrize("put_status", [403, 404, 405])
def test_imdsv1_only_upstream_falls_back_to_tokenless(make_server, pods, put_status):
    with FakeImds(token_mode="v1-only", token_put_status=put_status) as v1:
        server = make_server(metadata_addr=v1.addr)
        for _ in range(3):
            assert server.get("/latest/meta-data/instance-id").status == 200
        gets = [q for q in v1.requests if q.method == "GET"]
        assert all(q.token is None for q in gets)
        assert sum(q.method == "PUT" for q in v1.requests) == 1  # not one PUT per request


def test_a_stale_agent_token_is_replaced(make_server, pods):
    with FakeImds(token_mode="required") as strict:
        server = make_server(metadata_addr=strict.addr)
        assert server.get("/latest/meta-data/instance-id").status == 200
        strict._tokens.clear()  # the metadata service forgot every token (restart)
        assert server.get("/latest/meta-data/instance-id").status == 200
        assert sum(q.method == "PUT" for q in strict.requests) == 2


def test_canonical_path_is_forwarded(server, imds):
    assert server.get("/latest//meta-data/./placement/../instance-id").status == 200
    assert imds.requests[-1].path == "/latest/meta-data/instance-id"


def test_query_is_forwarded(server, imds):
    server.get("/latest/meta-data/instance-id?foo=bar")
    assert imds.requests[-1].path == "/latest/meta-data/instance-id?foo=bar"


def test_upstream_404_is_passed_on(server, imds):
    r = server.get("/latest/meta-data/no-such-thing")
    assert r.status == 404


def test_head_is_forwarded_without_a_body(server, imds):
    r = server.get("/latest/meta-data/instance-id", method="HEAD")
    assert r.status == 200
    assert r.header("Content-Length") == str(len(b"i-0fa4e1a5e0000cafe"))


def test_non_get_methods_are_not_forwarded(server, imds):
    assert server.get("/latest/meta-data/instance-id", method="POST").status == 405
    assert server.get("/latest/meta-data/instance-id", method="DELETE").status == 405
    assert imds.requests == []


def test_p2_upstream_down_is_a_fast_503(make_server, pods):
    server = make_server(metadata_addr=f"127.0.0.1:{free_port()}")
    r = server.get("/latest/meta-data/instance-id")
    assert r.status == 503


def test_p2_upstream_that_never_answers_is_503_within_the_budget(make_server, pods):
    # Accepts connections (backlog) but never reads or answers: the worst case.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    try:
        server = make_server(metadata_addr=f"127.0.0.1:{hole.getsockname()[1]}")
        t0 = time.monotonic()
        r = server.get("/latest/meta-data/instance-id")
        elapsed = time.monotonic() - t0
        assert r.status == 503
        assert elapsed >= 0.25  # it waited for the upstream budget (0.3 s), then gave up
    finally:
        hole.close()


def test_slow_upstream_does_not_hold_other_requests(make_server, pods):
    pods.add("127.0.0.1", "app-role")
    with FakeImds(delay=0.25) as slow:
        server = make_server(metadata_addr=slow.addr, upstream_timeout=2.0)
        results = {}

        def passthrough():
            results["pass"] = server.get("/latest/meta-data/instance-id").status

        t = threading.Thread(target=passthrough)
        t.start()
        time.sleep(0.05)
        r = server.get("/latest/meta-data/iam/security-credentials/", source="127.0.0.1")
        assert r.body == b"app-role"
        assert "pass" not in results  # answered while the passthrough was still waiting
        t.join(5)
        assert results["pass"] == 200
