"""What the asyncio and the blocking client share: the request line and headers, the
response object, and turning a non-2xx answer into an ``ApiError``."""
from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import quote, urlencode

import orjson

from kiamfast import __version__
from kiamfast.kube.errors import ApiError

USER_AGENT = f"kiamfast/{__version__}"
JSON = "application/json"
JSON_PATCH = "application/json-patch+json"

Params = Mapping[str, str | int | bool | None]


class Response:
    """A complete answer: status, headers (lower-case names), body bytes."""
    __slots__ = ("status", "reason", "headers", "body")

    def __init__(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return orjson.loads(self.body)

    def __repr__(self) -> str:
        return f"<Response {self.status} {len(self.body)} bytes>"


def target(base_path: str, path: str, params: Params | None) -> str:
    """The request target: the server's path prefix, ``path``, the query (None values
    left out, booleans as true/false)."""
    if not path.startswith("/"):
        raise ValueError(f"path must start with /: {path!r}")
    out = base_path + quote(path, safe="/:@!$&'()*+,;=-._~")
    if params:
        query = {k: ("true" if v else "false") if isinstance(v, bool) else str(v)
                 for k, v in params.items() if v is not None}
        if query:
            out += "?" + urlencode(query)
    return out


def encode_body(body: Any) -> bytes | None:
    """bytes as they are, anything else as JSON."""
    if body is None or isinstance(body, bytes):
        return body
    return orjson.dumps(body)


def headers(*, host: str, user_agent: str, authorization: str | None,
            body: bytes | None, content_type: str) -> dict[str, str]:
    out = {"Host": host, "User-Agent": user_agent, "Accept": JSON}
    if authorization:
        out["Authorization"] = authorization
    if body is not None:
        out["Content-Type"] = content_type
        out["Content-Length"] = str(len(body))
    return out


def api_error(status: int, reason: str, response_headers: Mapping[str, str],
              body: bytes) -> ApiError:
    """The error for a non-2xx answer, with the ``Status`` object's reason and message when
    the body is one (the API server's errors are)."""
    message = ""
    try:
        status_obj = orjson.loads(body) if body[:1] == b"{" else None
    except orjson.JSONDecodeError:
        status_obj = None
    if isinstance(status_obj, dict) and status_obj.get("kind") == "Status":
        reason = str(status_obj.get("reason") or reason)
        message = str(status_obj.get("message") or "")
    elif body:
        message = body[:200].decode("utf-8", "replace").strip().splitlines()[0] \
            if body.strip() else ""
    return ApiError(status, reason, message, retry_after=retry_after(response_headers),
                    body=body)


def retry_after(response_headers: Mapping[str, str]) -> float | None:
    value = response_headers.get("retry-after", "").strip()
    try:
        seconds = float(value)
    except ValueError:
        return None      # an HTTP-date: the API server never sends one
    return seconds if seconds >= 0 else None
