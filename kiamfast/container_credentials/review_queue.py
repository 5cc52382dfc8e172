"""The TokenReviews waiting for one of the reviewer's threads: bounded, shared by address,
and never run for nobody.

A review waits here, not in the thread pool's own queue (which has no bound and cannot drop
what it holds): with a slow API server, addresses sending new tokens faster than it answers
grew that queue without end, and every pod's new token then waited behind them until its
request gave up.  Here:

* at most `limit` reviews are pending (waiting or running) in all, and `per_address` for
  one address; past either, `QueueFull` (the caller answers 429, and the SDK retries);
* an address has one review running at a time, and a free thread takes the oldest review
  of the address served longest ago (an address not served in the last `REMEMBER` seconds
  first, in the order they came): a pod's new token, once an hour or so, goes before every
  address that keeps sending new tokens, those share what is left in turn, and however slow
  the API server, fewer flooding addresses than threads leave a thread to the others;
* a review whose every waiter has gone (its request answered 503 when its wait ended) is
  dropped before it starts (`abandon`); one already running is left to finish: its verdict
  is cached, and the SDK's retry finds it.

Runs on the event loop only: nothing here is shared with the threads.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from typing import Any, Awaitable, Callable

REMEMBER = 10.0        # seconds an address's last review start is remembered


class QueueFull(Exception):
    """No room for another review: in all, or for this address."""


class Job:
    """One review: its address, how to start it, its result (``future``), and how many
    requests wait for it."""
    __slots__ = ("address", "start", "future", "waiters", "started")

    def __init__(self, address: str, start: Callable[[], Awaitable[Any]],
                 future: asyncio.Future) -> None:
        self.address = address
        self.start = start
        self.future = future
        self.waiters = 0
        self.started = False


class ReviewQueue:
    def __init__(self, *, threads: int, limit: int, per_address: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threads = threads
        self.limit = limit
        self.per_address = per_address
        self.clock = clock
        self._waiting: dict[str, deque[Job]] = {}    # address -> its reviews not started
        self._pending: dict[str, int] = {}      # address -> its reviews waiting or running
        # address -> when a review of it last started, oldest first; forgotten after REMEMBER
        self._served: OrderedDict[str, float] = OrderedDict()
        self._running: set[str] = set()         # addresses with a review running
        self.queued = 0
        self.running = 0

    def submit(self, address: str, start: Callable[[], Awaitable[Any]]) -> Job:
        """Queue ``start`` (a coroutine function) for ``address``; `QueueFull` if there is
        no room."""
        if self.queued + self.running >= self.limit \
                or self._pending.get(address, 0) >= self.per_address:
            raise QueueFull
        job = Job(address, start, asyncio.get_running_loop().create_future())
        # A result nobody waits for any more is still retrieved (no "never retrieved" log).
        job.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._waiting.setdefault(address, deque()).append(job)
        self._pending[address] = self._pending.get(address, 0) + 1
        self.queued += 1
        self._pump()
        return job

    def abandon(self, job: Job) -> bool:
        """Its last waiter has gone: drop it if it has not started (True)."""
        if job.started or job.future.done():
            return False
        jobs = self._waiting[job.address]
        jobs.remove(job)
        if not jobs:
            del self._waiting[job.address]
        self.queued -= 1
        self._release(job.address)
        job.future.cancel()
        return True

    def _pump(self) -> None:
        while self.running < self.threads:
            now = self.clock()
            while self._served and next(iter(self._served.values())) < now - REMEMBER:
                self._served.popitem(last=False)
            # At most `limit` jobs wait, so this looks at no more than that many addresses.
            ready = [a for a in self._waiting if a not in self._running]
            if not ready:
                return
            address = min(ready, key=lambda a: self._served.get(a, float("-inf")))
            jobs = self._waiting[address]
            job = jobs.popleft()
            if not jobs:
                del self._waiting[address]
            self._served.pop(address, None)
            self._served[address] = now
            self.queued -= 1
            self.running += 1
            self._running.add(address)
            job.started = True
            task = asyncio.ensure_future(job.start())
            task.add_done_callback(lambda t, job=job: self._finished(job, t))

    def _finished(self, job: Job, task: asyncio.Future) -> None:
        self.running -= 1
        self._running.discard(job.address)
        self._release(job.address)
        if task.cancelled():
            job.future.cancel()
        elif task.exception() is not None:
            job.future.set_exception(task.exception())
        else:
            job.future.set_result(task.result())
        self._pump()

    def _release(self, address: str) -> None:
        left = self._pending[address] - 1
        if left:
            self._pending[address] = left
        else:
            del self._pending[address]
