"""Budgets and retries: the agent's one token bucket, one keyed budget, one backoff and one
way of logging an outage.

* :func:`backoff`: the jittered exponential delay before a retry (a watch, a runtime poll, a
  taint removal, one credential key's failures, a child's restart): every caller that
  retries uses this one.
* :class:`Episode`: when a failing dependency's outage is logged: its first failure (and,
  for a long one, a reminder every so often), and its end; the caller writes the lines.
* :class:`TokenBucket`: ``rate`` tokens per second, at most ``burst`` saved up, plus a global
  pause that throttling answers extend (exponential, jittered) and an adaptive rate (AIMD):
  each throttling answer halves the rate (once per window of calls, down to ``min_rate``),
  each success adds ``increase`` back, up to the configured rate.  STS throttles per account
  and region and every node's agent shares that budget: a pause alone would resume at the
  full rate and throttle again, the rate is what keeps a fleet of agents, each unaware of
  the others, under the account's budget.
* :class:`KeyedBudget`: a plain token bucket per key (a client address, a pod), the keys seen
  longest ago forgotten first beyond a bound: what keeps one pod's flood from taking a
  shared path away from the others.

Everything takes an injected clock (and async sleep) so tests drive time by hand.  A leaf
module: it imports nothing of the agent's.
"""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from typing import Awaitable, Callable, Hashable

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


def backoff(attempt: int, *, base: float, cap: float, rng: random.Random | None = None,
            jitter: bool = True) -> float:
    """Delay before retry number ``attempt`` (1-based): "equal jitter" exponential backoff.

    ``min(cap, base * 2**(attempt-1))`` scaled by a uniform factor in [0.5, 1.0], so retries of
    many keys that failed together spread out without ever retrying much sooner than planned
    (``jitter=False``: not scaled, for a retry nothing else shares: a child's restart).
    """
    exp = min(cap, base * (2 ** max(0, min(attempt - 1, 30))))
    return exp * (rng or random).uniform(0.5, 1.0) if jitter else exp


class Episode:
    """One dependency's outage, for its log lines: :meth:`failed` is True at its first
    failure (the line that says it began) and, with ``every``, once every ``every`` seconds
    while it lasts (a reminder: a bare agent outside a cluster must not fill its log);
    :meth:`recovered` is True once, when it ends.  The caller logs; this says when."""

    def __init__(self, *, every: float | None = None, clock: Clock = time.monotonic) -> None:
        self.every = every
        self.clock = clock
        self.since: float | None = None      # when the outage began (None: no outage)
        self._logged = 0.0

    @property
    def failing(self) -> bool:
        return self.since is not None

    @property
    def lasted(self) -> float:
        """Seconds since the outage began (0 without one)."""
        return self.clock() - self.since if self.since is not None else 0.0

    def failed(self) -> bool:
        now = self.clock()
        if self.since is None:
            self.since = self._logged = now
            return True
        if self.every is not None and now - self._logged >= self.every:
            self._logged = now
            return True
        return False

    def recovered(self) -> bool:
        ended = self.since is not None
        self.since = None
        return ended


class TokenBucket:
    """A token bucket with a global pause, driven by an injectable clock."""

    MIN_RATE_DIVISOR = 16     # the adaptive rate never drops below rate / 16 (or min_rate)
    INCREASE_DIVISOR = 8      # ... and each success gives back rate / 8

    def __init__(self, rate: float, burst: int, *, clock: Clock, sleep: Sleep | None = None,
                 min_rate: float | None = None, tokens: float | None = None):
        """``tokens``: saved up at the start (default: a full burst)."""
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.max_rate = float(rate)
        self.rate = float(rate)             # the adaptive rate, at most max_rate
        self.min_rate = min(self.max_rate, min_rate if min_rate is not None
                            else self.max_rate / self.MIN_RATE_DIVISOR)
        self.increase = self.max_rate / self.INCREASE_DIVISOR
        self.burst = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._tokens = float(burst) if tokens is None else min(float(burst), tokens)
        self._last = clock()
        self.paused_until = 0.0
        self.taken = 0
        self.tickets = 0        # tokens handed out so far: the ticket of the last one
        self._cut_ticket = 0    # tickets up to this one were out when the rate was last cut

    def _refill(self, now: float) -> None:
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = max(self._last, now)

    @property
    def tokens(self) -> float:
        self._refill(self._clock())
        return self._tokens

    def try_take(self) -> float:
        """Take a token if one is available now; else return how long to wait (> 0)."""
        now = self._clock()
        self._refill(now)
        if now < self.paused_until:
            return self.paused_until - now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.taken += 1
            self.tickets += 1
            return 0.0
        return (1.0 - self._tokens) / self.rate

    async def take(self) -> None:
        """Wait for a token (and for any pause to end), then take it."""
        while True:
            wait = self.try_take()
            if wait <= 0:
                return
            if self._sleep is None:
                import asyncio      # not at the top: the supervisor runs no event loop
                self._sleep = asyncio.sleep
            await self._sleep(wait)

    def borrow(self) -> bool:
        """Take a token now, past the rate and any pause, if the debt stays within ``burst``
        tokens: later tokens pay it back, so over time the rate holds (a burst's worth
        sooner, at most).  False: no token."""
        self._refill(self._clock())
        if self._tokens - 1.0 < -self.burst:
            return False
        self._tokens -= 1.0
        self.taken += 1
        self.tickets += 1
        return True

    def refund(self) -> None:
        """Give back a token that was taken but not used."""
        self._tokens = min(self.burst, self._tokens + 1.0)
        self.taken -= 1

    def pause(self, seconds: float) -> None:
        """Stop handing out tokens for ``seconds`` (extends, never shortens, a pause) and
        drop the saved-up burst, so the end of a pause does not release a burst at once."""
        now = self._clock()
        self._refill(now)
        self.paused_until = max(self.paused_until, now + seconds)
        self._tokens = min(self._tokens, 1.0)   # one probe may go out when the pause ends
        self._last = max(self._last, self.paused_until)  # nothing accrues while paused

    def slow_down(self, ticket: int) -> None:
        """A call (the token with this ticket) was throttled: halve the rate.  Once per window
        of calls: answers to calls that were already out when the rate was cut tell of the
        same congestion, so eight throttled calls in flight cut it once, not eight times."""
        if ticket <= self._cut_ticket:
            return
        self._refill(self._clock())       # tokens saved so far accrued at the old rate
        self.rate = max(self.min_rate, self.rate / 2)
        self._cut_ticket = self.tickets

    def speed_up(self) -> None:
        """A call succeeded: give some rate back (additive increase)."""
        self._refill(self._clock())
        self.rate = min(self.max_rate, self.rate + self.increase)


class KeyedBudget:
    """A token bucket per key (``rate`` per second after a burst of ``burst``), kept across
    connections (a new connection must not bring a full bucket).  A bucket full again is
    forgotten (a missing one is a full one: nothing changes), so what is kept is the keys
    used in the last ``burst / rate`` seconds, at most ``keys`` of them, the least recently
    used forgotten first: nothing is kept per client or pod that has gone quiet."""

    def __init__(self, rate: float, burst: int, *, keys: int = 4096,
                 clock: Clock) -> None:
        self.rate, self.burst, self.keys = float(rate), float(burst), keys
        self.clock = clock
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()

    def take(self, key: Hashable) -> bool:
        """One token from ``key``'s bucket, if it has one."""
        now = self.clock()
        tokens, last = self._buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.keys:
            self._buckets.popitem(last=False)
        while True:          # least recently used first: the ones full again are forgotten
            tokens, last = next(iter(self._buckets.values()))
            if tokens + (now - last) * self.rate < self.burst:
                return allowed
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)

