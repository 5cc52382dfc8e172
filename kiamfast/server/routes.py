"""Request-target normalisation and routing for the metadata server.

Pods reach the worker as if it were the EC2 instance-metadata service. Most paths are passed
through to the real service, but a few must never be: the credential routes under
``meta-data/iam/`` are answered from the table, and ``identity-credentials/`` and
``user-data`` are blocked because they hold the *node's* secrets. A path that merely looks
different (``//``, ``/./``, ``/../``, ``%2F``, ``%2e%2e``, ``\\``, upper case) must route
exactly like its canonical form, or a pod could walk around the interception and read the
node's role from upstream.

So this module never forwards what it received: it decodes the target once, resolves dot
segments itself, refuses anything outside a small safe alphabet (including a ``%`` left
over from double encoding and ``;`` path parameters), classifies the canonical segments
case-insensitively, and hands the passthrough the canonical path it classified. Whatever
the upstream does with that path, it is the path this module judged.

The worker calls :func:`classify` once per distinct raw target and caches the result, so
this code is off the hot path and written for clarity.
"""

from __future__ import annotations

from typing import NamedTuple

# Route kinds (small ints: the Cython worker switches on them).
PASS = 0  # everything else: forwarded to the metadata service
TOKEN = 1  # /<version>/api/token
LISTING = 2  # /<version>/meta-data/iam/security-credentials[/]
DOCUMENT = 3  # /<version>/meta-data/iam/security-credentials/<name>
EXT_LISTING = 4  # /<version>/meta-data/iam/security-credentials-extended[/]
EXT_DOCUMENT = 5  # /<version>/meta-data/iam/security-credentials-extended/<name>
INFO = 6  # /<version>/meta-data/iam/info
DENY = 7  # user-data, identity-credentials/, anything else under meta-data/iam/
HEALTHZ = 8  # /healthz
READYZ = 9  # /readyz
METRICS = 10  # /metrics
DEBUG_STORE = 11  # /debug/store
BAD = 12  # not a path this server accepts: 400

NAMES = {
    PASS: "reverseProxyHandler", TOKEN: "tokenHandler", LISTING: "securityCredentialsHandler",
    DOCUMENT: "roleHandler", EXT_LISTING: "securityCredentialsHandler",
    EXT_DOCUMENT: "roleHandler", INFO: "infoHandler", DENY: "blockedHandler",
    HEALTHZ: "healthHandler", READYZ: "readyHandler", METRICS: "metricsHandler",
    DEBUG_STORE: "debugStoreHandler", BAD: "badRequest",
}

# Bytes allowed in a decoded path. Everything IMDS serves fits; anything else (a leftover
# '%', ';' parameters, controls, spaces, non-ASCII) is refused rather than interpreted.
_SAFE = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,=:@/"
)
_SAFE_QUERY = frozenset(range(0x21, 0x7F)) - {ord("#")}
_HEX = b"0123456789abcdefABCDEF"

_BLOCKED_SEGMENTS = frozenset({b"user-data", b"identity-credentials"})


class Route(NamedTuple):
    kind: int
    name: bytes | None = None  # role name in the URL (DOCUMENT, EXT_DOCUMENT)
    forward: bytes | None = None  # canonical path (+ "?query") for PASS


_BAD = Route(BAD)


def _percent_decode(raw: bytes) -> bytes | None:
    """Decode %XX once; None on a malformed escape."""
    if b"%" not in raw:
        return raw
    out = bytearray()
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == 0x25:  # '%'
            h = raw[i + 1:i + 3]
            if len(h) != 2 or h[0] not in _HEX or h[1] not in _HEX:
                return None
            out.append(int(h, 16))
            i += 3
        else:
            out.append(c)
            i += 1
    return bytes(out)


def canonical_segments(path: bytes) -> tuple[list[bytes], bool] | None:
    """Decode and resolve a path; (segments, trailing_slash), or None if refused."""
    decoded = _percent_decode(path)
    if decoded is None:
        return None
    decoded = decoded.replace(b"\\", b"/")
    if not decoded.startswith(b"/") or not _SAFE.issuperset(decoded):
        return None
    segs: list[bytes] = []
    parts = decoded.split(b"/")
    for part in parts:
        if part == b"" or part == b".":
            continue
        if part == b"..":
            if segs:
                segs.pop()
            continue
        segs.append(part)
    last = parts[-1]
    trailing = bool(segs) and last in (b"", b".", b"..")
    return segs, trailing


def split_target(target: bytes) -> tuple[bytes, bytes] | None:
    """(path, query) of an origin-form or absolute-form request target."""
    if target[:1] != b"/":
        low = target[:8].lower()
        if low.startswith(b"http://") or low.startswith(b"https://"):
            rest = target[target.index(b"//") + 2:]
            slash = rest.find(b"/")
            target = rest[slash:] if slash >= 0 else b"/"
        else:
            return None  # "*" or garbage
    target = target.split(b"#", 1)[0]
    path, _, query = target.partition(b"?")
    return path, query


def classify(target: bytes) -> Route:
    """Route one raw request target (as it arrived on the request line)."""
    split = split_target(target)
    if split is None:
        return _BAD
    path, query = split
    canon = canonical_segments(path)
    if canon is None:
        return _BAD
    segs, trailing = canon
    low = [s.lower() for s in segs]
    n = len(low)

    if n == 1 and low[0] == b"healthz":
        return Route(HEALTHZ)
    if n == 1 and low[0] == b"readyz":
        return Route(READYZ)
    if n == 1 and low[0] == b"metrics":
        return Route(METRICS)
    if n == 2 and low[0] == b"debug" and low[1] == b"store":
        return Route(DEBUG_STORE)
    if n == 3 and low[1] == b"api" and low[2] == b"token":
        return Route(TOKEN)

    if _BLOCKED_SEGMENTS.intersection(low):
        return Route(DENY)
    for i in range(n - 1):
        if low[i] == b"meta-data" and low[i + 1] == b"iam":
            if i != 1:
                return Route(DENY)  # iam under no or a nested prefix: never upstream
            return _classify_iam(segs[3:], low[3:])

    if query and not _SAFE_QUERY.issuperset(query):
        return _BAD
    forward = b"/" + b"/".join(segs) + (b"/" if trailing else b"")
    if query:
        forward += b"?" + query
    return Route(PASS, forward=forward)


def _classify_iam(rest: list[bytes], low: list[bytes]) -> Route:
    if not rest:
        return Route(DENY)
    head = low[0]
    if head == b"security-credentials":
        if len(rest) == 1:
            return Route(LISTING)
        return Route(DOCUMENT, name=b"/".join(rest[1:]))
    if head == b"security-credentials-extended":
        if len(rest) == 1:
            return Route(EXT_LISTING)
        return Route(EXT_DOCUMENT, name=b"/".join(rest[1:]))
    if head == b"info" and len(rest) == 1:
        return Route(INFO)
    return Route(DENY)
