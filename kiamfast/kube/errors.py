"""The three ways a call to the API server can fail, told apart for the caller.

``ConfigError``: nothing to retry; the message is one line naming the flag or file that
fixes it. ``ApiError``: the server answered with a non-2xx status. ``ApiUnavailable``: no
answer (refused, reset, TLS failure, timeout): an outage, to retry with backoff.
"""
from __future__ import annotations


class ConfigError(Exception):
    """The client cannot be configured; ``str(e)`` is one line naming the flag or file."""


class ApiError(Exception):
    """A non-2xx answer. ``reason`` and ``message`` come from the body's ``Status`` when it
    has one (``Forbidden``, ``NotFound``, ``Expired``, ...); ``retry_after`` in seconds from
    the ``Retry-After`` header, else None."""

    def __init__(self, status: int, reason: str = "", message: str = "", *,
                 retry_after: float | None = None, body: bytes = b"") -> None:
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.body = body
        text = f"HTTP {status}"
        if reason:
            text += f" {reason}"
        if message:
            text += f": {message}"
        super().__init__(text.replace("\n", " ")[:500])


class ApiUnavailable(Exception):
    """No answer from the API server: connection refused or reset, TLS failure, the stream
    broken mid-way. Retry with backoff."""


class ApiTimeout(ApiUnavailable):
    """No answer in time: the connect, the request, or (on a stream) the inactivity timeout."""
