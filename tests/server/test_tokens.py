"""IMDSv2 token PUT (sdk-imds.md §10 T1–T5) and the stateless token scheme."""

from __future__ import annotations

import re
import time

import pytest

from kiamfast import table
from kiamfast.server.tokens import TokenSigner, parse_ttl

from server_support import TOKEN_KEY, Client, build

TOKEN_RE = re.compile(r"^[A-Za-z0-9+/=_-]{20,128}$")
TTL = "X-aws-ec2-metadata-token-ttl-seconds"


def put(server, ttl=None, *, source="127.0.0.1", headers=None, path="/latest/api/token"):
    h = dict(headers or {})
    if ttl is not None:
        h[TTL] = ttl
    return server.get(path, source=source, method="PUT", headers=h)


# ---- over the wire ---------------------------------------------------------------------------

def test_t1_put_grants_a_bare_token_with_the_ttl_header(make_server, pods, loop_kind):
    server = make_server(loop_kind=loop_kind)
    r = put(server, "21600", source="127.0.0.9")  # an address the table does not know
    assert r.status == 200
    assert TOKEN_RE.match(r.text), r.body
    assert r.body == r.body.strip()
    assert r.header("X-Aws-Ec2-Metadata-Token-Ttl-Seconds") == "21600"
    assert r.header("Content-Length") == str(len(r.body))
    assert r.header("Content-Type") == "text/plain"
    # The unknown pod was never looked up: nothing was asked of the control process.
    assert server.messages(timeout=0.2) == []


def test_t2_granted_ttl_is_echoed(server):
    r = put(server, "300")
    assert r.status == 200
    assert r.header("X-Aws-Ec2-Metadata-Token-Ttl-Seconds") == "300"


@pytest.mark.parametrize("ttl", [None, "0", "21601", "-1", "abc", "", "1.5", "300 300"])
def test_t3_missing_or_bad_ttl_is_400(server, ttl):
    r = put(server, ttl)
    assert r.status == 400


def test_ttl_header_name_is_case_insensitive(server):
    r = put(server, headers={"X-AWS-EC2-METADATA-TOKEN-TTL-SECONDS": "60"})
    assert r.status == 200
    assert r.header("X-Aws-Ec2-Metadata-Token-Ttl-Seconds") == "60"


def test_t4_put_with_x_forwarded_for_is_403(server):
    r = put(server, "21600", headers={"X-Forwarded-For": "10.1.2.3"})
    assert r.status == 403


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE", "HEAD"])
def test_t5_other_methods_on_the_token_path_are_405(server, method):
    r = server.get("/latest/api/token", method=method)
    assert r.status == 405
    assert r.header("Allow") == "OPTIONS, PUT"


def test_token_path_under_any_version_and_odd_spelling(server):
    for path in ("/2021-07-15/api/token", "//latest/api/token", "/latest/./api/token",
                 "/latest/api%2Ftoken"):
        assert put(server, "60", path=path).status == 200, path


def test_token_works_for_the_pod_that_asked_only(server, pods):
    pods.add("127.0.0.21", "role-a")
    pods.add("127.0.0.22", "role-b")
    path = "/latest/meta-data/iam/security-credentials/"
    token_a = server.token(source="127.0.0.21")
    ok = server.get(path, source="127.0.0.21", headers={"X-aws-ec2-metadata-token": token_a})
    assert (ok.status, ok.text) == (200, "role-a")
    stolen = server.get(path, source="127.0.0.22",
                        headers={"X-aws-ec2-metadata-token": token_a})
    assert stolen.status == 401


def test_token_survives_a_worker_restart(make_server, pods):
    pods.add("127.0.0.1", "role-a")
    first = make_server()
    token = first.token()
    first.stop()
    second = make_server()  # same key, new process state
    r = second.get("/latest/meta-data/iam/security-credentials/",
                   headers={"X-aws-ec2-metadata-token": token})
    assert (r.status, r.text) == (200, "role-a")


def test_get_with_a_token_reports_the_remaining_ttl(server, pods):
    pods.add("127.0.0.1", "role-a")
    token = server.token(ttl=600)
    r = server.get("/latest/meta-data/iam/security-credentials/role-a",
                   headers={"X-aws-ec2-metadata-token": token})
    assert r.status == 200
    assert 595 <= int(r.header("X-Aws-Ec2-Metadata-Token-Ttl-Seconds")) <= 600


def test_many_puts_on_one_connection(server):
    with Client(server.port) as c:
        for _ in range(20):
            r = c.request(build("PUT", "/latest/api/token", {TTL: "21600"}))
            assert r.status == 200 and TOKEN_RE.match(r.text)


# ---- the scheme itself -------------------------------------------------------------------------

ADDR = table.ip_key("10.0.0.7")
OTHER = table.ip_key("10.0.0.8")


def test_token_is_valid_for_at_least_its_ttl_and_then_expires():
    s = TokenSigner(TOKEN_KEY)
    now = 1_700_000_000
    tok = s.issue(ADDR, 300, now)
    assert len(tok) == 44 and TOKEN_RE.match(tok.decode())
    assert s.verify(ADDR, tok, now) > now
    assert s.verify(ADDR, tok, now + 300) > 0  # the whole TTL, whatever the fraction
    assert s.verify(ADDR, tok, now + 301) == -1


def test_token_is_bound_to_address_and_key():
    s = TokenSigner(TOKEN_KEY)
    tok = s.issue(ADDR, 300, 1_700_000_000)
    assert s.verify(OTHER, tok, 1_700_000_000) == -1
    assert TokenSigner(b"another-key-of-32-bytes-000000000").verify(ADDR, tok, 1_700_000_000) == -1


@pytest.mark.parametrize("junk", [b"", b"x", b"A" * 44, b"!" * 44, b"A" * 43 + b"\n",
                                  b"A" * 200])
def test_garbage_tokens_are_rejected(junk):
    assert TokenSigner(TOKEN_KEY).verify(ADDR, junk, int(time.time())) == -1


def test_a_tampered_expiry_is_rejected():
    import base64
    s = TokenSigner(TOKEN_KEY)
    raw = bytearray(base64.b64decode(s.issue(ADDR, 1, 1_700_000_000)))
    raw[5] ^= 0x01  # move the expiry years ahead
    assert s.verify(ADDR, base64.b64encode(bytes(raw)), 1_700_000_000) == -1


@pytest.mark.parametrize("value,expected", [
    (b"1", 1), (b"21600", 21600), (b" 300 ", 300), (b"0300", 300),
    (b"0", -1), (b"21601", -1), (b"-1", -1), (b"+5", -1), (b"abc", -1), (b"", -1),
    (None, -1), (b"9999999", -1),
])
def test_parse_ttl(value, expected):
    assert parse_ttl(value) == expected


def test_short_keys_are_refused():
    with pytest.raises(ValueError):
        TokenSigner(b"short")
