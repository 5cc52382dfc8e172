"""When each credential key's STS call runs: the queue, the timers and the node's STS budget.

One STS call per key at a time (single flight); every call takes a token from the node's
bucket (``--sts-qps``/``--sts-burst``, :class:`kiamfast.budget.TokenBucket`); a throttled call
pauses the bucket (jittered exponential: the budget is account-wide) and halves its rate
(AIMD); successes give rate back; with a fleet budget the rate never drops below this node's
share of it (:func:`node_share`), which every node may always use.  At most ``max_inflight``
calls are out at once.

A fleet arriving together (an autoscaler adding hundreds of nodes at once) stays within the
account's budget from its first call.  With a fleet budget a node *starts* at its share with
one token, and grows above it only after ``probe_after`` seconds without a throttling answer
(from its start or the last one); nodes calm that long probe up to ``--sts-qps`` while STS
accepts (a fleet whose nodes are mostly idle uses the budget).  Every call also takes a
token of the node's *pace*, ``1 - headroom`` of its rate, whose first token comes at a
random moment: nodes that start together do not call together, and the fleet's prefetch
and refresh never take more than that part of the budget.  The headroom is for the calls
no pod can wait for, which may go beyond the pace (below).  Nodes starting at
``--sts-qps`` with a full burst took almost twice the budget at once and throttled each
other; ``bench/fleet_sim.py`` measures both.

Calls are taken earliest deadline first: by priority, then by when the credentials are
needed (:func:`deadline`).  A key a pod is *waiting* for (a worker said so) comes first, in
the order the pods asked; then keys nobody has credentials for yet, the pods that can ask
soonest first (:meth:`Schedule.sooner`); then refresh-ahead, the credentials that stop being
servable soonest first.  A waited-for key keeps its priority through its retries until it is
servable.  A worker holds a pod's request only for its wait budget (0.35 s), so a waited-for
key does not wait for the node's token, pace or pause: it borrows a token (debt of at most a
burst, which later tokens pay back by delaying the next prefetch: over time the node's rate
holds).

The schedule knows nothing of STS or the table: it runs ``fetch(entry, ticket)`` (one call,
:mod:`.calls`) and fires ``on_timer(entry, kind)`` for the timers it keeps ("fetch" timers
re-queue the entry themselves).  An entry is any object with the scheduling fields of the
manager's ``KeyEntry`` (:mod:`.slots`).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from typing import Awaitable, Callable, Protocol

from kiamfast.budget import TokenBucket, backoff

PRIO_WANTED = 0     # a worker has a request waiting for this slot
PRIO_NEW = 1        # prefetch of a key nobody has credentials for yet, or its retry
PRIO_REFRESH = 2    # refresh-ahead of credentials still being served

# A throttled call of a key a pod's request is held for retries once this soon (seconds):
# within the worker's wait budget (0.35 s by default), and spread so retries do not align.
QUICK_RETRY = (0.05, 0.15)

# With a fleet budget, a node stays at its share until it has run this long (seconds)
# without a throttling answer: longer than a fleet's arrival takes to prefetch ...
PROBE_AFTER = 60.0
# ... and its pace leaves this part of its rate to the keys its pods ask for before they
# are fetched (bench/fleet_sim.py's arrival at 500 nodes and 150/s: 0.2 peaked at 1.13x
# the budget, 0.3 at 1.05x; at 2,000 nodes and 600/s, 0.3 at 1.07x).
HEADROOM = 0.3


def node_share(account_qps: float, fleet_nodes: int, node_qps: float) -> float:
    """The STS rate this node may always use: its even share of the fleet's budget
    (``account_qps`` over ``fleet_nodes`` agents), never more than ``node_qps``.  Every
    agent at its share keeps the fleet within the budget whatever the arrival pattern, so
    throttling never cuts a node's adaptive rate below it; above it a node probes up to
    ``node_qps`` while STS accepts (a fleet whose nodes are mostly idle uses the budget)."""
    if account_qps <= 0:
        return node_qps
    if fleet_nodes < 1:
        raise ValueError("a fleet budget needs the number of nodes sharing it")
    return min(node_qps, account_qps / fleet_nodes)


def node_bucket(*, qps: float, burst: int, account_qps: float, fleet_nodes: int,
                clock: Callable[[], float],
                sleep: Callable[[float], Awaitable[None]]) -> TokenBucket:
    """The node's STS bucket.  A node of a fleet (``account_qps``) starts at its share, with
    one token; with no node count yet (it comes from the API) the floor is the one without
    a budget until :meth:`Schedule.share_fleet`: the lower of the two."""
    fleet = account_qps > 0
    bucket = TokenBucket(
        qps, burst, clock=clock, sleep=sleep,
        min_rate=node_share(account_qps, fleet_nodes, qps)
        if fleet and fleet_nodes > 0 else None, tokens=1.0 if fleet else None)
    if fleet:
        bucket.rate = bucket.min_rate
    return bucket


class Entry(Protocol):
    """What the schedule reads and writes of a key (``slots.SlotEntry``), knowing nothing
    else of it."""
    addressed: bool
    asked_at: float
    due: float
    freed: bool
    idle_since: float | None
    inflight: bool
    queued: tuple | None
    serve_until: float
    timer: int
    timer_prio: int
    unsendable: bool
    waiting: bool


def deadline(entry: Entry, prio: int) -> tuple[float, ...]:
    """The key's place within its priority (earliest deadline first): waited-for keys in
    the order their pods asked; new keys, those of addressed pods first, then by when their
    first pod arrived; refreshes by when their credentials stop being servable."""
    if prio == PRIO_WANTED:
        return (entry.asked_at,)
    if prio == PRIO_NEW:
        return (0.0 if entry.addressed else 1.0, entry.due)
    return (entry.serve_until,)


# Stale heap items tolerated beyond the live ones before the heap is rebuilt without them.
STALE_SLACK = 16


def _bounded(heap: list, live: Callable[[tuple], bool]) -> list:
    """The heap without its stale items: those of a freed entry, or that ``live`` says are
    superseded (each entry has one live item per heap at most)."""
    kept = [item for item in heap if not item[-1].freed and live(item)]
    heapq.heapify(kept)
    return kept


class Schedule:
    """The ready queue, the timers and the dispatcher of STS calls."""

    def __init__(self, *, bucket: TokenBucket, max_inflight: int,
                 fetch: Callable[[Entry, int], Awaitable[None]],
                 on_timer: Callable[[Entry, str], None],
                 clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]],
                 probe_after: float = 0.0, headroom: float = 0.0,
                 throttle_base: float = 1.0, throttle_max: float = 30.0,
                 rng: random.Random | None = None) -> None:
        self.bucket = bucket
        self.probe_after = probe_after
        self.rng = rng or random.Random()
        # Every call also takes a token of the pace, (1 - headroom) of the node's rate (a
        # waited-for key borrows one); its first token comes at a random moment.
        self.headroom = headroom
        self.pace = TokenBucket(bucket.rate * (1.0 - headroom), max(1, int(bucket.burst)),
                                clock=clock, sleep=sleep, tokens=self.rng.random()
                                ) if headroom else None
        self.max_inflight = max(1, max_inflight)
        self.fetch = fetch
        self.on_timer = on_timer
        self.clock = clock
        self.sleep = sleep
        self.throttle_base, self.throttle_max = throttle_base, throttle_max
        self.inflight = 0
        self.queued = 0                     # entries with a live item in the ready queue
        # Both heaps keep an item until it comes up, also once it is stale (the entry was
        # re-queued, re-timed or freed); `_bounded` drops the stale ones when they would
        # outnumber the live ones, so a key that is gone is never kept alive by them.
        self._ready: list[tuple[tuple[float, ...], int, Entry]] = []
        self._timers: list[tuple[float, int, int, str, Entry]] = []
        self._ready_bound = self._timers_bound = STALE_SLACK
        self._seq = itertools.count()
        self._token_wait = False
        self._throttle_streak = 0
        self._calm_since = clock()          # the start, or the last throttling answer
        self._work = asyncio.Event()        # the ready queue got an item
        self._timer_wake = asyncio.Event()  # an earlier timer was added
        self._slot_free = asyncio.Event()   # an in-flight call finished
        self._fetches: set[asyncio.Task] = set()
        self._closed = False

    # ---- what the manager asks ---------------------------------------------------------------

    def enqueue(self, entry: Entry, prio: int) -> None:
        """Queue the entry (again, if its priority or deadline moved up)."""
        if entry.freed or entry.inflight or entry.unsendable:
            return
        if entry.waiting:
            prio = PRIO_WANTED
        order = (prio, *deadline(entry, prio))
        if entry.queued is not None and entry.queued <= order:
            return
        if entry.queued is None:
            self.queued += 1
        entry.queued = order
        heapq.heappush(self._ready, (order, next(self._seq), entry))
        if len(self._ready) > self._ready_bound:
            self._ready = _bounded(self._ready, lambda item: item[2].queued == item[0])
            self._ready_bound = 2 * len(self._ready) + STALE_SLACK
        self._work.set()

    def sooner(self, entry: Entry, *, addressed: bool) -> None:
        """A pod acquired the key (or came back with more to say): its deadline moves up to
        when this pod could ask.  A pod with an address can ask at any moment; one without
        cannot until its sandbox has one, so any addressed pod's key comes first."""
        now = self.clock()
        if addressed and not entry.addressed:
            entry.addressed, entry.due = True, now
        elif not entry.addressed:
            entry.due = min(entry.due, now)
        else:
            return
        if entry.queued is not None:
            self.enqueue(entry, entry.queued[0])   # re-ranked if it moved up

    def dequeue(self, entry: Entry) -> None:
        """Forget a queued item (the entry is freed)."""
        entry.timer += 1
        if entry.queued is not None:
            entry.queued = None
            self.queued -= 1

    def set_timer(self, entry: Entry, at: float, kind: str, prio: int = PRIO_NEW) -> None:
        """The entry's one live timer (an older one is ignored when it fires)."""
        entry.timer += 1
        heapq.heappush(self._timers, (at, next(self._seq), entry.timer, kind, entry))
        if len(self._timers) > self._timers_bound:
            self._timers = _bounded(self._timers, lambda item: item[2] == item[4].timer)
            self._timers_bound = 2 * len(self._timers) + STALE_SLACK
        entry.timer_prio = prio
        if self._timers[0][4] is entry:
            self._timer_wake.set()

    def cancel_timer(self, entry: Entry) -> None:
        entry.timer += 1

    @property
    def probing(self) -> bool:
        """Whether successes may take the rate up (``probe_after`` calm seconds have passed)."""
        return self.clock() - self._calm_since >= self.probe_after

    def share_fleet(self, account_qps: float, nodes: int) -> float:
        """``nodes`` agents now share ``account_qps``: the floor throttling may cut this
        node's rate down to follows its share (:func:`node_share`), which it runs at
        exactly until it has been calm long enough to probe.  Returns the share."""
        share = node_share(account_qps, nodes, self.bucket.max_rate)
        self.bucket.tokens      # what was saved so far accrued at the old rate
        self.bucket.min_rate = share
        self.bucket.rate = max(self.bucket.rate, share) if self.probing else share
        return share

    def succeeded(self) -> None:
        """An STS call succeeded: the rate may grow back (once the node has been calm)."""
        self._throttle_streak = 0
        if self.probing:
            self.bucket.speed_up()

    def throttled(self, ticket: int) -> None:
        """The call that took token ``ticket`` was throttled: the whole node pauses and slows."""
        self._calm_since = max(self._calm_since, self.clock())
        self._throttle_streak += 1
        self.bucket.pause(backoff(self._throttle_streak, base=self.throttle_base,
                                  cap=self.throttle_max, rng=self.rng))
        self.bucket.slow_down(ticket)

    @property
    def settled(self) -> bool:
        """Nothing in flight and nothing that could start before time moves on (queued work
        waiting for a token or the end of a throttling pause counts as settled)."""
        return not (self.inflight or (self.queued and not self._token_wait))

    @property
    def blocked(self) -> bool:
        """Nothing more can start before time moves on or a call in flight returns (a
        simulation whose STS takes simulated time waits for this)."""
        return (not self.queued or self._token_wait
                or self.inflight >= self.max_inflight)

    # ---- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        """The dispatcher and the timers, until :meth:`close` (then in-flight calls go)."""
        tasks = [asyncio.create_task(self._dispatch(), name="kiamfast-cred-dispatch"),
                 asyncio.create_task(self._timer_loop(), name="kiamfast-cred-timers")]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception():
                    raise task.exception()   # a scheduler bug: let the supervisor see it
        finally:
            for task in [*tasks, *self._fetches]:
                task.cancel()
            await asyncio.gather(*tasks, *self._fetches, return_exceptions=True)

    def close(self) -> None:
        self._closed = True
        self._work.set()
        self._timer_wake.set()
        self._slot_free.set()

    def _wanted_first(self) -> bool:
        """The best item of the queue is a key a pod is waiting for."""
        while self._ready:
            order, _, entry = self._ready[0]
            if entry.freed or entry.queued != order:
                heapq.heappop(self._ready)
                continue
            return order[0] == PRIO_WANTED
        return False

    def _pop_ready(self) -> Entry | None:
        while self._ready:
            order, _, entry = heapq.heappop(self._ready)
            if entry.freed or entry.queued != order:
                continue  # superseded by a better priority or deadline, or freed
            entry.queued = None
            self.queued -= 1
            if entry.inflight or entry.idle_since is not None:
                continue
            return entry
        return None

    async def _wait_any(self, event: asyncio.Event, delay: float | None) -> None:
        waits = [asyncio.ensure_future(event.wait())]
        if delay is not None:
            waits.append(asyncio.ensure_future(self.sleep(max(0.0, delay))))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _timer_loop(self) -> None:
        while not self._closed:
            now = self.clock()
            while self._timers and self._timers[0][0] <= now:
                _, _, version, kind, entry = heapq.heappop(self._timers)
                if entry.freed or version != entry.timer:
                    continue
                if kind == "fetch":
                    self.enqueue(entry, entry.timer_prio)
                else:
                    self.on_timer(entry, kind)
            self._timer_wake.clear()
            delay = self._timers[0][0] - now if self._timers else None
            await self._wait_any(self._timer_wake, delay)

    async def _dispatch(self) -> None:
        while not self._closed:
            if not self.queued:
                self._work.clear()
                await self._work.wait()
                continue
            if self.inflight >= self.max_inflight:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            wait = self.bucket.try_take()
            wanted = self._wanted_first()
            if wait > 0 and wanted and self.bucket.borrow():
                wait = 0.0      # a pod is held for it: go now, later tokens pay it back
            paced = wait <= 0 and self.pace is not None
            if paced:
                wait = self._pace_take()
                if wait > 0 and wanted and self.pace.borrow():
                    wait = 0.0
                elif wait > 0:
                    self.bucket.refund()
            if wait > 0:  # rate limit or throttling pause: sleep, then look again
                self._token_wait = True
                self._work.clear()      # a key a pod waits for cuts the wait short
                try:
                    await self._wait_any(self._work, wait)
                finally:
                    self._token_wait = False
                continue
            entry = self._pop_ready()
            if entry is None:
                self.bucket.refund()
                if paced:
                    self.pace.refund()
                continue
            entry.inflight = True
            self.inflight += 1
            task = asyncio.create_task(self._run_fetch(entry, self.bucket.tickets))
            self._fetches.add(task)
            task.add_done_callback(self._fetches.discard)

    def _pace_take(self) -> float:
        """A token of the pace, which follows the node's rate (0), or how long to wait."""
        self.pace.tokens                    # what it saved so far, at the rate it had
        self.pace.rate = self.bucket.rate * (1.0 - self.headroom)
        return self.pace.try_take()

    async def _run_fetch(self, entry: Entry, ticket: int) -> None:
        try:
            await self.fetch(entry, ticket)
        finally:
            self._slot_free.set()

    def finished(self, entry: Entry) -> None:
        """The manager's fetch of ``entry`` returned (called before it handles the result)."""
        entry.inflight = False
        self.inflight -= 1
        self._slot_free.set()
