"""Routing and path normalisation: nothing that means iam/, identity-credentials/ or user-data
may ever be forwarded, however it is spelled (sdk-imds.md §6, L8)."""

from __future__ import annotations

import posixpath
import re
import urllib.parse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiamfast.server import routes
from kiamfast.server.routes import classify


@pytest.mark.parametrize("target,kind,name", [
    (b"/latest/api/token", routes.TOKEN, None),
    (b"/latest/meta-data/iam/security-credentials/", routes.LISTING, None),
    (b"/latest/meta-data/iam/security-credentials", routes.LISTING, None),
    (b"/2016-09-02/meta-data/iam/security-credentials/", routes.LISTING, None),
    (b"/latest/meta-data/iam/security-credentials/app", routes.DOCUMENT, b"app"),
    (b"/latest/meta-data/iam/security-credentials/app/", routes.DOCUMENT, b"app"),
    (b"/latest/meta-data/iam/security-credentials/team/App", routes.DOCUMENT, b"team/App"),
    (b"/latest/meta-data/iam/security-credentials-extended/", routes.EXT_LISTING, None),
    (b"/latest/meta-data/iam/security-credentials-extended/app", routes.EXT_DOCUMENT, b"app"),
    (b"/latest/meta-data/iam/info", routes.INFO, None),
    (b"/latest/meta-data/iam/info/", routes.INFO, None),
    (b"/latest/meta-data/iam/", routes.DENY, None),
    (b"/latest/meta-data/iam/info/x", routes.DENY, None),
    (b"/latest/user-data", routes.DENY, None),
    (b"/latest/meta-data/identity-credentials/ec2/info", routes.DENY, None),
    (b"/healthz", routes.HEALTHZ, None),
    (b"/readyz", routes.READYZ, None),
    (b"/metrics", routes.METRICS, None),
    (b"/debug/store", routes.DEBUG_STORE, None),
    (b"http://169.254.169.254/latest/meta-data/iam/info", routes.INFO, None),
    (b"*", routes.BAD, None),
    (b"/latest/%zz", routes.BAD, None),
    (b"/latest/a%00b", routes.BAD, None),
    (b"/latest/a%20b", routes.BAD, None),
])
def test_classify(target, kind, name):
    r = classify(target)
    assert (r.kind, r.name) == (kind, name)


@pytest.mark.parametrize("target,forward", [
    (b"/latest/meta-data/instance-id", b"/latest/meta-data/instance-id"),
    (b"/latest/meta-data/", b"/latest/meta-data/"),
    (b"//latest//meta-data///placement/region", b"/latest/meta-data/placement/region"),
    (b"/latest/meta-data/x/../instance-id", b"/latest/meta-data/instance-id"),
    (b"/../../latest/meta-data/instance-id", b"/latest/meta-data/instance-id"),
    (b"/latest/meta-data/placement/.", b"/latest/meta-data/placement/"),
    (b"/latest/meta-data/%69nstance-id", b"/latest/meta-data/instance-id"),
    (b"/latest/meta-data/instance-id?a=b", b"/latest/meta-data/instance-id?a=b"),
    (b"/", b"/"),
])
def test_passthrough_forwards_the_canonical_path(target, forward):
    r = classify(target)
    assert r.kind == routes.PASS
    assert r.forward == forward


# ---- property: an independent, more paranoid normaliser as the oracle -----------------------

def _oracle_segments(path: str) -> list[str]:
    """Decode repeatedly (double/triple encoding), treat \\ as /, resolve dots, lower-case."""
    for _ in range(5):
        decoded = urllib.parse.unquote(path)
        if decoded == path:
            break
        path = decoded
    path = path.replace("\\", "/").split("?", 1)[0].split("#", 1)[0]
    norm = posixpath.normpath("/" + path).lower()
    return [s for s in norm.split("/") if s]


def sensitive(path: str) -> bool:
    segs = _oracle_segments(path)
    if "user-data" in segs or "identity-credentials" in segs:
        return True
    return any(segs[i] == "meta-data" and segs[i + 1] == "iam" for i in range(len(segs) - 1))


SEGMENTS = st.sampled_from([
    "latest", "2016-09-02", "meta-data", "META-DATA", "iam", "IAM", "Iam",
    "security-credentials", "security-credentials-extended", "info", "user-data",
    "identity-credentials", "ec2", "instance-id", "placement", "region", "api", "token",
    ".", "..", "", "%2e", "%2E%2E", "%2F", "%2f", "%252F", "%5C", "\\", "%69am", "i%61m",
    "meta%2Ddata", "x", ";", "iam;x", "%", "%00", "?", "#",
])


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SEGMENTS, min_size=0, max_size=8), st.booleans())
def test_nothing_sensitive_is_ever_forwarded(segs, trailing):
    target = "/" + "/".join(segs) + ("/" if trailing else "")
    r = classify(target.encode())
    if r.kind == routes.PASS:
        assert not sensitive(target), target
        assert not sensitive(r.forward.decode()), (target, r.forward)
        # What goes upstream is already canonical: nothing left to decode or resolve.
        path = r.forward.split(b"?", 1)[0]
        assert b"%" not in path and b"\\" not in path
        assert b"/./" not in path + b"/" and b"/../" not in path + b"/" and b"//" not in path


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_crash_the_router(raw):
    r = classify(b"/" + raw)
    assert r.kind in routes.NAMES
    if r.kind == routes.PASS:
        assert re.fullmatch(rb"[!-~]+", r.forward)


# ---- end to end: the real worker in front of a recording fake IMDS --------------------------

def test_fuzzed_paths_through_the_worker_never_reach_upstream_when_sensitive(make_server, pods,
                                                                             imds):
    from server_support import Client, build

    server = make_server()
    client = Client(server.port)

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.lists(SEGMENTS.filter(lambda s: s not in ("?", "#", "%")), max_size=7),
           st.booleans())
    def check(segs, trailing):
        nonlocal client
        path = "/" + "/".join(segs) + ("/" if trailing else "")
        raw = build("GET", path)
        try:
            client.send(raw)
            got = client.read(1)
        except OSError:
            got = []
        if not got or client.closed:
            client.close()
            client = Client(server.port)
        for rec in imds.requests:
            assert not sensitive(rec.path), (path, rec.path)
            assert b"NODE" not in (got[0].body if got else b"")

    try:
        check()
    finally:
        client.close()
    assert imds.requests, "the fuzzer never produced a passthrough at all"
