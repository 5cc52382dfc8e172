"""Responses the worker renders itself (everything that is not a pre-rendered table part).

Credential responses come ready-made from the table (rendered once by the control process).
What is left is rendered here: token grants, errors with kube2iam's texts, operational
routes and passthrough answers. All of them look like real IMDS on the wire (sdk-imds.md
§5): ``Server: EC2ws``, ``Content-Type``, ``Content-Length``, and no body whitespace a
client could choke on. Error bodies keep kube2iam's text plus the newline Go's
``http.Error`` appends, so log scrapers and people migrating see familiar messages.

Nothing here is on the hot path of a cached credential GET; the fixed responses are
pre-built once at import.
"""

from __future__ import annotations

import json
from http import HTTPStatus

SERVER = b"EC2ws"


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def render(status: int, body: bytes = b"", *, content_type: bytes = b"text/plain",
           headers: tuple[tuple[bytes, bytes], ...] = (), length: int | None = None) -> bytes:
    """A complete HTTP/1.1 response; ``length`` overrides Content-Length (HEAD answers)."""
    out = [b"HTTP/1.1 %d %s\r\n" % (status, reason(status))]
    if content_type:
        out.append(b"Content-Type: " + content_type + b"\r\n")
    out.append(b"Accept-Ranges: none\r\n")
    for name, value in headers:
        out.append(name + b": " + value + b"\r\n")
    out.append(b"Server: EC2ws\r\nContent-Length: %d\r\n\r\n"
               % (len(body) if length is None else length))
    out.append(body)
    return b"".join(out)


def error(status: int, text: str | bytes, **kw: object) -> bytes:
    """An error response with a kube2iam-style text body (text + newline)."""
    if isinstance(text, str):
        text = text.encode("utf-8", "replace")
    return render(status, text + b"\n", **kw)  # type: ignore[arg-type]


def token(value: bytes, ttl: int) -> bytes:
    """The answer to a token PUT: the bare token and the granted TTL."""
    return (b"HTTP/1.1 200 OK\r\nX-Aws-Ec2-Metadata-Token-Ttl-Seconds: %d\r\n"
            b"Content-Type: text/plain\r\nAccept-Ranges: none\r\nServer: EC2ws\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (ttl, len(value), value))


# Fixed answers, built once.
BAD_REQUEST = error(400, "bad request")
BAD_TTL = error(400, "X-Aws-Ec2-Metadata-Token-Ttl-Seconds must be an integer from 1 to 21600")
FORBIDDEN_XFF = error(403, "forbidden: token requests must not carry X-Forwarded-For")
TOKEN_NOT_ALLOWED = error(405, "method not allowed", headers=((b"Allow", b"OPTIONS, PUT"),))
TOKEN_OPTIONS = render(200, b"", headers=((b"Allow", b"OPTIONS, PUT"),))
UNAUTHORIZED = error(401, "unauthorized: a valid IMDSv2 session token is required")
BLOCKED = error(404, "not found")
NOT_FOUND = BLOCKED
METHOD_NOT_ALLOWED = error(405, "method not allowed")
PAYLOAD_TOO_LARGE = error(413, "request body too large")
URI_TOO_LONG = error(414, "request target too long")
HEADERS_TOO_LARGE = error(431, "request header fields too large")
REQUEST_TIMEOUT = error(408, "request timeout")
TOO_SMALL = error(500, "internal error: response buffer too small")
INTERNAL_ERROR = error(500, "internal error")
UPSTREAM_UNAVAILABLE = error(503, "metadata service unavailable")
# RFC 6585's code for rate limiting, as the EKS Pod Identity Agent answers (sdk-imds.md §8);
# real IMDS documents no status for its own throttling (it limits queries and connections).
PASSTHROUGH_LIMITED = error(429, "too many metadata requests from this address, retry later",
                            headers=((b"Retry-After", b"1"),))
NOT_READY = error(503, "not ready")
READY = render(200, b"ok\n")


def not_ready(health_blob: bytes) -> bytes:
    """``/readyz``'s 503 with what the agent waits for (the health blob's ``readiness``, put
    there by the control process; plain "not ready" while it says nothing)."""
    try:
        why = json.loads(health_blob).get("readiness") if health_blob.startswith(b"{") else None
    except ValueError:
        why = None
    if not isinstance(why, str) or not why.startswith("waiting"):
        return NOT_READY
    return error(503, f"not ready: {why}"[:1024])


def not_found_pod(ip: str) -> bytes:
    # kube2iam's text for an address no pod owns (its typo included).
    return error(404, f'pod with specificed IP "{ip}" not found')


def no_role(ip: str) -> bytes:
    return error(404, f"unable to find role for IP {ip}")


def denied(ip: str, role_arn: str | None = None, namespace: str | None = None) -> bytes:
    if role_arn is None:
        return error(404, f"role requested by pod at {ip} is not valid for its namespace")
    # kube2iam's text for a role its namespace does not allow.
    return error(404, f"role requested {role_arn} not valid for namespace of pod at {ip} "
                      f"with namespace {namespace}")


def invalid_role(name: bytes) -> bytes:
    return error(404, b"Invalid role " + name)


def unavailable(ip: str) -> bytes:
    return error(503, f"credentials for IP {ip} are not available yet, retry")


def health(blob: bytes) -> bytes:
    """``/healthz`` from the control process' health blob (aux 2), kube2iam's shape."""
    if blob.startswith(b"{"):
        body = blob if blob.endswith(b"\n") else blob + b"\n"
        return render(200, body, content_type=b"application/json")
    detail = blob.decode("utf-8", "replace").strip() or "health check has not run yet"
    return error(500, f"Error getting instance id {detail}")
