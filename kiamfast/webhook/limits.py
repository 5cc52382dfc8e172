"""The webhook's memory bounds: what a review may cost to hold and to parse, summed over every
connection, so that no client can take the process past its memory limit (96 MiB in the
chart; about 25 MiB at rest).

Two budgets, each a count of bytes reserved before they are used and released after:

* bodies being received: a body over `SMALL_BODY` reserves its announced length before a
  byte of it is read (`BODY_BUDGET` in all); smaller ones need none, the connection cap
  bounds them (64 × 64 KiB);
* reviews being parsed and answered: every review reserves `parse_cost` of its body, an upper
  bound of what ``json.loads`` takes for it, from the parse until its answer is sent, and,
  once parsed and before its answer is built, `answer_cost` of the pod's containers, an upper
  bound of what building the JSONPatch and the AdmissionReview answer takes (`PARSE_BUDGET`
  in all).  A review of a small cost (`SMALL_COST`, every ordinary pod) may use the whole
  budget; a larger one must leave `KEEP_FOR_SMALL` free, so large reviews never keep the
  ordinary ones out.  A review whose two costs together could never fit is answered without
  a patch (the pod admitted uninjected, the answer's ``warnings`` saying why): a 372 KB review
  of 124,000 empty containers parses within the budget, and its answer took 330 MiB to build.

A reservation that cannot be made at once waits at most `BUDGET_WAIT`; then the API server
is told to try again (429 with ``Retry-After``: its client retries within its own timeout).
"""
from __future__ import annotations

import threading

# The API server accepts a request body of at most 3 MiB and etcd stores an object of at most
# 1.5 MiB (both defaults, measured on the real ones); a pod of long strings reviews at its
# own size + 2 KiB.  Dense pods review larger (defaults and managedFields per variable or
# container), up to 6 MiB for valid ones that no one runs (20,000 containers).
MAX_REVIEW_BYTES = 2 << 20
SMALL_BODY = 64 << 10
BODY_BUDGET = 12 << 20
PARSE_BUDGET = 24 << 20
SMALL_COST = 1 << 20
KEEP_FOR_SMALL = 4 << 20
BUDGET_WAIT = 1.0
# Building an answer, per container of the pod (measured at most 4.4 KiB with tracemalloc:
# the operations, their JSON, its base64 and the AdmissionReview's JSON and bytes) and once
# (the rest of the answer; the role is at most MAX_ROLE characters, the flags' texts few).
ANSWER_PER_CONTAINER = 6 << 10
ANSWER_FIXED = 64 << 10


def parse_cost(body: bytes) -> int:
    """An upper bound of the memory ``json.loads(body)`` takes, the body included: per byte,
    the body, its decoded text and the strings cut from it with the buffers they are built in
    (4 bytes a character once one is outside the BMP, even written as an ASCII escape; 10
    unless the body is ASCII); per separator or container, the Python object it becomes
    (measured with tracemalloc on the densest shapes: tests/podidentity/
    test_webhook_limits.py).  Counted with ``bytes.count``: no allocation."""
    per_byte = 8 if body.isascii() else 10
    separators = body.count(b",") + body.count(b":")
    containers = body.count(b"{") + body.count(b"[")
    return per_byte * len(body) + 48 * separators + 96 * containers


def answer_cost(containers: int, full_uri: str) -> int:
    """An upper bound of the memory building the answer for a pod of ``containers``
    containers and init containers takes, its patch naming ``full_uri`` in each (measured
    with tracemalloc on the densest shapes: tests/podidentity/test_webhook_limits.py)."""
    return ANSWER_FIXED + containers * (ANSWER_PER_CONTAINER + 8 * len(full_uri))


class ByteBudget:
    """``total`` bytes shared by threads: `reserve` waits (bounded) for room, `release`
    returns it.  ``keep``: what a reservation over ``small`` must leave free."""

    def __init__(self, total: int, *, small: int | None = None, keep: int = 0) -> None:
        self.total, self.keep = total, keep
        self.small = total if small is None else small
        self.used = 0
        self._room = threading.Condition()

    def fits(self, n: int) -> bool:
        """Whether ``n`` could ever be reserved."""
        return n <= self.total - (self.keep if n > self.small else 0)

    def reserve(self, n: int, *, timeout: float, held: int = 0) -> bool:
        """``n`` more bytes for a reservation that holds ``held`` already (the two are one
        reservation for `fits` and ``keep``)."""
        limit = self.total - (self.keep if held + n > self.small else 0)
        with self._room:
            if not self._room.wait_for(lambda: self.used + n <= limit, timeout):
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._room:
            self.used -= n
            self._room.notify_all()
