"""The token listener's HTTP/1.1: a request head parsed strictly (a NUL, a stray CR or LF, a
repeated or malformed header, a body: refused without a review), an answer and the
protocol's JSON error body ``{"Code", "Message"}``."""
from __future__ import annotations

import http
from dataclasses import dataclass

import orjson


class BadRequest(Exception):
    pass


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """Request line and headers (names lower-cased); `BadRequest` for anything odd."""
    text = head[:-4].decode("latin-1")
    # A NUL, or a CR or LF that does not end a line, is never part of a field (RFC 9110
    # 5.5: reject): a token carrying one is refused here, without a review.
    if "\0" in text or not text.count("\r") == text.count("\n") == text.count("\r\n"):
        raise BadRequest("a NUL, CR or LF inside a request line or header")
    try:
        lines = text.split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest("unsupported HTTP version")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        name = name.lower()
        if not sep or not name or name != name.strip() or name in headers:
            raise BadRequest(f"malformed or repeated header {name!r}")
        headers[name] = value.strip()
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise BadRequest("a request body is not accepted")
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" and (version == "HTTP/1.1" or connection == "keep-alive")
    return Request(method, target.partition("?")[0], headers, keep_alive)


def response(status: int, body: bytes, *, keep_alive: bool,
             extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in extra)]
    if not keep_alive:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"Code": code, "Message": message})
