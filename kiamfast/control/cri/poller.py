"""The runtime poller: polls on one dedicated thread (the CRI calls never touch the event
loop), periodically and on demand (`need()`), demands coalesced into one follow-up poll and
started at least `DEMAND_FLOOR` apart; an outage reported once and retried with jittered
backoff.  The client (`client.py`) says what a poll sees."""
from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from typing import Any

from kiamfast.budget import Episode, backoff
from kiamfast.control.cri.client import RuntimeClient, RuntimeUnavailable, RuntimeView

log = logging.getLogger("kiamfast.runtime")

# Demand polls start at least this far apart (below): a first call waits at most
# this much longer than the runtime's answer, a seventh of --wait-budget's 0.35 s.
DEMAND_FLOOR = 0.05


class RuntimePoller:
    """Runs polls on one worker thread; on demand and periodically; coalesced.

    `need()` and `run()` belong to one event loop; `need()` may also be called from another
    thread. `on_view`, `on_failure` and `on_state` are called on the event loop thread.
    `on_state` is called at every change of health, the first poll's outcome included;
    `on_failure(started_ns)` after every failed attempt, dated like a view (before the
    request).

    A demand starts a poll before the periodic one is due, but never sooner than
    `demand_floor` after the previous demand poll began: every need that arrives during a
    poll or during the floor is served by the one poll that follows, so one pod opening
    connections in a loop costs the runtime at most 1/floor polls per second (plus the
    periodic ones), and a first call waits at most the floor longer.  During an outage a
    demand gets an attempt the same way: the runtime may be back before the backoff ends,
    and a connection accepted meanwhile must be judged by an attempt begun after it.
    """

    def __init__(self, client: RuntimeClient, *, on_view: Callable[[RuntimeView], None],
                 on_state: Callable[[bool, str], None],
                 on_failure: Callable[[int], None] = lambda started_ns: None,
                 interval: float = 1.0, backoff_max: float = 30.0, backoff_min: float = 0.2,
                 demand_floor: float = DEMAND_FLOOR, rng: Any = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.client = client
        self._on_view = on_view
        self._on_state = on_state
        self._on_failure = on_failure
        self.demand_floor = demand_floor
        self.interval = interval
        self.backoff_max = backoff_max
        self.backoff_min = min(backoff_min, backoff_max)
        self._rng = rng or random.Random()
        self._clock_ns = clock_ns
        self.healthy = False
        self.last_error = ""
        self.last_view_ns = 0        # clock_ns() when the last view was applied (for /healthz)
        self._outage = Episode()
        self._told: bool | None = None   # the state on_state was last told
        self._wanted_ns = -1         # the largest after_ns asked for by need()
        self._last_started_ns = -1   # started_ns of the last view handed to on_view
        self._last_attempt_ns = -1   # when the last attempt (view or failure) began
        self._demand_began = float("-inf")   # loop time the last demand poll began
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.stats: dict[str, int] = {"polls": 0, "failed_polls": 0, "outages": 0,
                                      "needs": 0, "demand_polls": 0}

    @property
    def last_view_started_ns(self) -> int:
        return self._last_started_ns

    def need(self, after_ns: int) -> None:
        """A request needs a view whose started_ns >= after_ns (a connection accepted at after_ns).
        If a poll is running that started before after_ns, another one follows it (not sooner
        than the floor); requests arriving meanwhile are coalesced into that poll."""
        loop = self._loop
        if loop is not None and loop.is_running():
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:
                on_loop = False
            if not on_loop:
                loop.call_soon_threadsafe(self.need, after_ns)
                return
        self.stats["needs"] += 1
        # a view started from now on satisfies any honest after_ns; one from the future
        # (another clock, a bug) must not make the poller poll back to back forever
        after_ns = min(after_ns, self._clock_ns())
        if after_ns > self._wanted_ns:
            self._wanted_ns = after_ns
        if self._wake is not None and self._demanded():
            self._wake.set()

    def _demanded(self) -> bool:
        return self._wanted_ns > self._last_attempt_ns

    async def run(self) -> None:
        """Forever: poll every `interval` s, or sooner when need() asks (see the floor above).
        Never raises for runtime faults; cancel it to stop."""
        loop = asyncio.get_running_loop()
        self._loop, self._wake = loop, asyncio.Event()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiamfast-cri")
        failures = 0
        early = False                              # the first poll is nobody's demand
        try:
            while True:
                self._wake.clear()
                self.stats["polls"] += 1
                if early:
                    self.stats["demand_polls"] += 1
                    self._demand_began = loop.time()
                attempt_ns = self._clock_ns()      # not after the client's own request
                try:
                    view = await loop.run_in_executor(executor, self.client.poll)
                except Exception as exc:   # RuntimeUnavailable, or a bug: never out of run()
                    failures += 1
                    self.stats["failed_polls"] += 1
                    self._last_attempt_ns = attempt_ns
                    self._unhealthy(exc)
                    try:
                        self._on_failure(attempt_ns)
                    except Exception:
                        log.exception("CRI %s: on_failure failed", self.client.endpoint)
                    early = await self._pause(self._backoff(failures))
                    continue
                failures = 0
                self._last_started_ns = view.started_ns
                self._last_attempt_ns = max(attempt_ns, view.started_ns)
                self.last_view_ns = self._clock_ns()
                self._healthy()
                try:
                    self._on_view(view)
                except Exception:
                    log.exception("CRI %s: on_view failed", self.client.endpoint)
                early = await self._pause(self.interval)
        finally:
            self._loop = self._wake = None
            executor.shutdown(wait=False, cancel_futures=True)

    async def _pause(self, wait: float) -> bool:
        """Wait `wait` s (the interval or a backoff), or less when a request wants a poll:
        until demand_floor after the previous demand poll began. True if it ended early."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while not self._demanded():
            left = until - loop.time()
            if left <= 0:
                return False
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=left)
            except TimeoutError:
                return False
        start = min(until, self._demand_began + self.demand_floor)
        await asyncio.sleep(max(0.0, start - loop.time()))
        return start < until

    def _backoff(self, failures: int) -> float:
        return backoff(failures, base=self.backoff_min, cap=self.backoff_max, rng=self._rng)

    def _unhealthy(self, exc: Exception) -> None:
        message = str(exc) if isinstance(exc, RuntimeUnavailable) else (
            f"CRI endpoint {self.client.endpoint}: {type(exc).__name__}: {exc}")
        self.healthy, self.last_error = False, message
        if self._outage.failed():
            self.stats["outages"] += 1
            log.warning("container runtime unavailable (retrying with backoff): %s", message)
            self._tell_state(False, message)

    def _healthy(self) -> None:
        self.healthy, self.last_error = True, ""
        if self._outage.recovered():
            log.info("container runtime %s reachable again", self.client.endpoint)
        if self._told is not True:   # the first answer too: on_state hears every change
            self._tell_state(True, "")

    def _tell_state(self, healthy: bool, message: str) -> None:
        self._told = healthy
        try:
            self._on_state(healthy, message)
        except Exception:
            log.exception("CRI %s: on_state failed", self.client.endpoint)
