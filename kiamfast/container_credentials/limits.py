"""The token listener's bounds per client address and per pod, so that no client behaviour
takes the listener away from the other pods: connections held (per address and in all, a
newcomer taking the place of the longest idle connection of the address holding the most),
and token buckets of TokenReviews and of refusals per address and of answers per reviewed
pod (`kiamfast.budget.KeyedBudget`); an address past its refusals cools down (its requests
and new connections closed unread)."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable

from kiamfast.budget import KeyedBudget

MAX_CONNECTIONS = 512
MAX_CONNECTIONS_PER_ADDRESS = 16
REVIEW_RATE = 2.0               # reviews per second and address, after a burst of ...
REVIEW_BURST = 10
REFUSAL_RATE = 10.0             # refused requests per second and address, after a burst of ...
REFUSAL_BURST = 50
POD_ANSWER_RATE = 50.0          # requests per second and reviewed pod, after a burst of ...
POD_ANSWER_BURST = 200          # (an SDK asks once per process and credential refresh)
COOL_DOWN = 2.0                 # past that: the address's connections closed unread this long
BUCKETS = 4096                  # addresses (or pods) whose budgets are remembered, at most


class Connection:
    """One connection's place: whose it is, whether an answer is being made for it (bounded
    in time by the budgets of the request path), and since when it has been idle (its
    accept, or its last answer written; an answer waiting for its client to read it is
    idle: the client's to take, never the loop's)."""
    __slots__ = ("address", "transport", "busy", "idle_since")

    def __init__(self, address: str, transport: asyncio.BaseTransport, now: float) -> None:
        self.address = address
        self.transport = transport
        self.busy = False
        self.idle_since = now


class AddressLimits:
    """Connections held, a token bucket of TokenReviews and one of refusals, per client
    address, and one of answers per pod; an address past its refusals is cooling down (its
    connections closed at once)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.connections: dict[str, set[Connection]] = {}
        self.total = 0
        self.evicted = 0                          # idle connections closed for a newcomer
        self.turned_away = 0                      # connections refused: no place for them
        # Kept across connections (a new connection must not bring a full bucket) until the
        # bucket is full again (then it is as if new), the least recently used first.
        now = lambda: self.clock()   # noqa: E731 - the limits' clock, whenever it is set
        self._reviews = KeyedBudget(REVIEW_RATE, REVIEW_BURST, keys=BUCKETS, clock=now)
        self._refusals = KeyedBudget(REFUSAL_RATE, REFUSAL_BURST, keys=BUCKETS, clock=now)
        self._answers = KeyedBudget(POD_ANSWER_RATE, POD_ANSWER_BURST, keys=BUCKETS,
                                    clock=now)   # by pod uid
        self._cooling: OrderedDict[str, float] = OrderedDict()   # address -> until, in order
        self.cooled = 0                           # connections and requests closed unread

    def open(self, address: str, transport: asyncio.BaseTransport) -> Connection | None:
        """A place for a new connection from `address`, or None (then close it unread)."""
        mine = self.connections.get(address)
        held = len(mine) if mine else 0
        if held >= MAX_CONNECTIONS_PER_ADDRESS or (
                self.total >= MAX_CONNECTIONS and not self._make_room(held)):
            self.turned_away += 1
            return None
        conn = Connection(address, transport, self.clock())
        if mine is None:
            mine = self.connections[address] = set()
        mine.add(conn)
        self.total += 1
        return conn

    def _make_room(self, own: int) -> bool:
        """At MAX_CONNECTIONS: close an idle connection of an address holding at least two
        more than the newcomer's (`own`): of the address holding the most, the one idle
        longest, as the metadata path's workers do.  Any idle connection anywhere will do:
        an address whose connections are all being answered cannot keep a pod that holds
        none out, and nobody is left with fewer than the newcomer.  Only when every place
        is making an answer (each bounded in time) is the newcomer turned away."""
        idle = [c for conns in self.connections.values() if len(conns) >= own + 2
                for c in conns if not c.busy]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (-len(self.connections[c.address]), c.idle_since))
        self.close(victim)
        self.evicted += 1
        if victim.transport.get_write_buffer_size():
            victim.transport.abort()  # an answer it is not reading: nothing to wait for
        else:
            victim.transport.close()  # its reader sees the end, its client a FIN
        return True

    def close(self, conn: Connection) -> None:
        """Give the connection's place up (once: an evicted one gave it up already)."""
        mine = self.connections.get(conn.address)
        if mine is None or conn not in mine:
            return
        mine.discard(conn)
        self.total -= 1
        if not mine:
            del self.connections[conn.address]

    def allow_review(self, address: str) -> bool:
        return self._reviews.take(address)

    def allow_answer(self, pod_uid: str) -> bool:
        """One answer for a reviewed pod (whatever address its token came from)."""
        return self._answers.take(pod_uid)

    def refused(self, address: str) -> bool:
        """Count one refusal; True when it used up the budget and the cool-down begins."""
        now = self.clock()
        if self._refusals.take(address):
            return False
        self._cooling.pop(address, None)
        self._cooling[address] = now + COOL_DOWN     # the latest last: the same COOL_DOWN
        while next(iter(self._cooling.values())) <= now:     # only addresses still cooling
            self._cooling.popitem(last=False)
        return True

    def cooling(self, address: str) -> bool:
        until = self._cooling.get(address)
        if until is None:
            return False
        if until > self.clock():
            self.cooled += 1
            return True
        del self._cooling[address]
        return False
