"""The fleet against STS's account budget: many nodes' real credential managers, one bucket.

What runs is the production code: every simulated node is a real ``CredentialManager``
(prefetch, refresh, single flight, priorities, limiter, AIMD) with its own real table
(``kiamfast.table.Table`` with 8 credential slots, on /dev/shm), calling STS through the
real ``StsClient`` (botocore, signing, parsing).  All nodes of a run share one process and
one ``StsClient`` (the client is thread-safe and holds no per-node state; the node's state
is the manager's).  STS is moto's, behind the fault proxy enforcing ONE token bucket for the
whole fleet (``FaultProxy.set_budget``): over budget a call gets STS's ``Throttling: Rate
exceeded`` answer.

Time is simulated: the managers, the table's ``serve_until`` and the proxy's budget all run
on one ``ManualClock`` that moves only when every manager has settled (no call in flight,
nothing due), in steps of at most ``quantum`` seconds (calls due within one quantum leave
together).  So the figures do not depend on this machine's speed: moto answering 60 calls/s
of real time still meets a budget of 600/s of simulated time.

The schedule (``Scenario``): nodes become Ready uniformly over ``window`` seconds; each gets
``pods_per_node`` pods, bound ``schedule`` seconds after Ready (the startup taint is gone),
their roles spread over ``roles_per_node`` roles drawn from a pool of ``role_pool``; each
app's first credential request comes ``pull`` seconds later (image pull and start).  A
request is judged by the table, the way a worker answers it: it is served if the pod's slot
is servable before the client gives up.  Two client models (sdk-imds.md §2):

* ``botocore``: one attempt; the worker holds it for ``--wait-budget`` (0.35 s) and then
  answers 503, which botocore does not retry: patience 0.35 s.  From botocore's source
  (utils.py ``IMDSFetcher``, checked against 1.43.11 and 1.44.8): each request has a 1 s
  timeout (``DEFAULT_METADATA_SERVICE_TIMEOUT``, ``AWS_METADATA_SERVICE_TIMEOUT``) and
  ``num_attempts`` 1 (``AWS_METADATA_SERVICE_NUM_ATTEMPTS``); a non-200 answer would be
  retried, but within that one attempt there is none.  The fetch is the token PUT (the
  worker answers it at once), the listing and the document; the listing is the request held
  while the credentials are pending, and its 503 ends the fetch (no document request), so
  the wait budget, shorter than the timeout, is the whole patience;
* ``go``: the Go SDK retries 503 (3 attempts, backoff up to 1 s, 5 s per operation):
  patience 2 s.

A request that is not served tells the manager (``wanted``, as a worker does) and the app
tries again later: the kubelet's crash-loop back-off (10 s, doubling, at most 300 s) for
both models.  Every served document is checked against the proxy's record of the call that
issued its access key: same role, the node's session name; anything else counts as a
wrong identity.  ``others``: the account's other STS callers (CI jobs, other services),
a steady rate taken from the same budget (``FaultProxy.spend_budget``) after the fleet's
calls of each 50 ms step: how many of their calls the arrival left throttled.  ``sts_latency``: every STS call takes that long in
simulated time (the sim waits for such calls as for timers); 0 by default (STS answers at
once: what the budget allows, not how fast STS is).

``python bench/fleet_sim.py --scenario arrival|steady|brownout [--nodes N ...]`` prints one
JSON result; ``bench/run --only fleet`` runs the issue's scenarios side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import logging
import math
import os
import random
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import orjson

from kiamfast import table as tbl
from kiamfast import credential_parts
from kiamfast.control.iam.keys import CredentialRequest
from kiamfast.control.iam.manager import CredentialManager
from kiamfast.control.iam.sts import StsClient
from kiamfast.testing.sts import FaultProxy, ManualClock, MotoSts

ACCOUNT = "123456789012"
BASE = f"arn:aws:iam::{ACCOUNT}:role/"
PATIENCE = {"botocore": 0.35, "go": 2.0}
CRASHLOOP_FIRST, CRASHLOOP_MAX = 10.0, 300.0


@dataclass(frozen=True)
class Scenario:
    nodes: int = 2000
    window: float = 10.0                 # nodes Ready uniformly over this
    pods_per_node: int = 8
    roles_per_node: int = 5
    role_pool: int = 50
    schedule: tuple[float, float] = (0.5, 2.0)   # Ready -> pod bound (acquire)
    pull: tuple[float, float] = (5.0, 20.0)      # bound -> the app's first request
    budget: float = 600.0                # the account's STS bucket (calls/s) ...
    budget_burst: float | None = None    # ... and its burst (default: one second's worth)
    account_qps: float = 600.0           # --sts-account-qps (0: today's defaults)
    fleet_nodes: int | None = None       # --sts-fleet-nodes (default: nodes)
    qps: float = 5.0                     # --sts-qps
    burst: int = 20                      # --sts-burst
    client: str = "botocore"             # the apps' SDK: botocore | go
    duration: float = 180.0              # simulated seconds in all
    brownout: tuple[float, float, float] | None = None  # (start, length, fraction of budget)
    late_nodes: int = 0                  # nodes Ready during the brownout (new pods)
    sts_attempts: int = 1                # StsClient max_attempts (today: 2, botocore retries)
    quantum: float = 0.05
    seed: int = 1
    tag_keys: str = ""                   # --session-tags with these keys ("": no tags)
    others: float = 0.0                  # the account's other STS callers, calls/s, steady
    sts_latency: float = 0.0             # simulated seconds each STS call takes


@dataclass
class Pod:
    uid: str
    node: int
    role: str
    bound_at: float
    asks_at: float
    slot: int = -1
    attempts: int = 0
    last_ask: float = 0.0
    first_ok: bool | None = None
    served_at: float | None = None
    wrong_identity: bool = False


class SlowSts:
    """The STS client, each call taking ``latency`` seconds of simulated time first (it
    reaches STS then, and is answered at once); ``sleeping`` counts the calls waiting."""

    def __init__(self, sts: StsClient, clock: ManualClock, latency: float) -> None:
        self.sts, self.clock, self.latency = sts, clock, latency
        self.sleeping = 0

    async def assume_role(self, *args, **kwargs):
        self.sleeping += 1
        try:
            await self.clock.sleep(self.latency)
        finally:
            self.sleeping -= 1
        return await self.sts.assume_role(*args, **kwargs)


class RecordingTable:
    """The node's real table, plus when each slot turned servable or stopped being so."""

    def __init__(self, table: tbl.Table, clock, on_lost):
        self.table = table
        self.clock = clock
        self.on_lost = on_lost
        self.ready_at: dict[int, float] = {}

    def write_cred(self, slot, parts, *, serve_until, state):
        self._check_gap(slot)
        self.table.write_cred(slot, parts, serve_until=serve_until, state=state)
        if state == tbl.CRED_READY and serve_until > self.clock():
            self.ready_at.setdefault(slot, self.clock())

    def set_cred_state(self, slot, state, serve_until=None):
        was_servable = self.servable(slot, self.clock())
        if serve_until is None:
            self.table.set_cred_state(slot, state)
        else:
            self.table.set_cred_state(slot, state, serve_until)
        if was_servable and state != tbl.CRED_READY:
            self.on_lost(self, slot)

    def clear_cred(self, slot):
        self.ready_at.pop(slot, None)
        self.table.clear_cred(slot)

    def _check_gap(self, slot):
        state, serve_until, _ = self.table.read_cred(slot)
        if state == tbl.CRED_READY and serve_until < self.clock() - 1e-6:
            self.on_lost(self, slot)      # it was past serve_until before the new write

    def servable(self, slot: int, at: float) -> bool:
        state, serve_until, parts = self.table.read_cred(slot)
        return state == tbl.CRED_READY and serve_until > at and bool(parts)

    def access_key(self, slot: int) -> str | None:
        _, _, parts = self.table.read_cred(slot)
        status, _, body = credential_parts.parse_response(parts[tbl.PART_DOCUMENT])
        doc = orjson.loads(body)
        return doc.get("AccessKeyId") if status == 200 else None


class Fleet:
    def __init__(self, sc: Scenario, proxy: FaultProxy, sts: StsClient, clock: ManualClock,
                 tmp: str):
        self.sc, self.proxy, self.sts, self.clock, self.tmp = sc, proxy, sts, clock, tmp
        self.rng = random.Random(sc.seed)
        self.managers: list[CredentialManager] = []
        self.slow: list[SlowSts | None] = []
        self.tables: list[RecordingTable] = []
        self.tasks: list[asyncio.Task] = []
        self.pods: list[Pod] = []
        self.lost: list[tuple[int, int, float]] = []   # (node, slot, at) a pod lost its creds
        self.users: dict[tuple[int, int], int] = {}     # (node, slot) -> pods using it
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = 0
        self.others: dict[int, list[int]] = {}         # second -> [taken, throttled]
        self._others_due = 0.0
        self._others_last = 0.0

    # ---- the schedule -------------------------------------------------------------------
    def plan(self) -> None:
        sc, rng = self.sc, self.rng
        pool = [f"role-{i:03d}" for i in range(sc.role_pool)]
        for n in range(sc.nodes):
            ready = rng.uniform(0.0, sc.window)
            if sc.brownout and n >= sc.nodes - sc.late_nodes:
                ready = sc.brownout[0] + rng.uniform(0.0, sc.brownout[1])
            self._at(ready, "node", n)
            roles = rng.sample(pool, sc.roles_per_node)
            for p in range(sc.pods_per_node):
                bound = ready + rng.uniform(*sc.schedule)
                pod = Pod(uid=f"n{n}-p{p}", node=n, role=roles[p % len(roles)],
                          bound_at=bound, asks_at=bound + rng.uniform(*sc.pull))
                self.pods.append(pod)
                self._at(bound, "bind", pod)
                self._at(pod.asks_at, "ask", pod)
        if sc.brownout:
            start, length, fraction = sc.brownout
            self._at(start, "budget", sc.budget * fraction)
            self._at(start + length, "budget", sc.budget)

    def _at(self, t: float, kind: str, what) -> None:
        self._seq += 1
        heapq.heappush(self._events, (self.t0 + t, self._seq, kind, what))

    # ---- nodes and pods -----------------------------------------------------------------
    def start_node(self, n: int) -> None:
        sc = self.sc
        table = tbl.Table.create(os.path.join(self.tmp, f"node-{n}"), ip_capacity=16,
                                 cred_capacity=8, value_size=8192, aux_count=1,
                                 aux_size=64, max_workers=1)
        rec = RecordingTable(table, self.clock.time, lambda t, slot, n=n: self._lost(n, slot))
        slow = SlowSts(self.sts, self.clock, sc.sts_latency) if sc.sts_latency else None
        mgr = CredentialManager(
            table=rec, sts=slow or self.sts, capacity=8, node_name=f"node-{n}",
            base_role_arn=BASE,
            qps=sc.qps, burst=sc.burst, account_qps=sc.account_qps,
            fleet_nodes=sc.fleet_nodes or sc.nodes, clock=self.clock.time,
            session_tags=bool(sc.tag_keys), tag_keys=sc.tag_keys or "kiamfast",
            cluster_name="sim" if sc.tag_keys else "",
            sleep=self.clock.sleep, rng=random.Random(sc.seed * 100003 + n))
        self.managers.append(mgr)
        self.slow.append(slow)
        self.tables.append(rec)
        self.tasks.append(asyncio.create_task(mgr.run()))
        self.node_index[n] = len(self.managers) - 1

    def _lost(self, n: int, slot: int) -> None:
        if self.users.get((n, slot)):
            self.lost.append((n, slot, self.clock.time() - self.t0))

    def bind(self, pod: Pod) -> None:
        mgr = self.managers[self.node_index[pod.node]]
        pod.slot = mgr.acquire(pod.uid, CredentialRequest(
            role_arn=BASE + pod.role, namespace="ml", pod_name=pod.uid))
        self.users[(pod.node, pod.slot)] = self.users.get((pod.node, pod.slot), 0) + 1

    def ask(self, pod: Pod) -> None:
        """One attempt of the app: served if the slot is servable within the SDK's
        patience; otherwise the worker tells the manager, and the app tries again later."""
        if pod.served_at is not None:
            return
        now = self.clock.time()
        pod.attempts += 1
        pod.last_ask = now
        self.managers[self.node_index[pod.node]].wanted(pod.slot)
        self._at(now - self.t0 + PATIENCE[self.sc.client], "judge", pod)

    def judge(self, pod: Pod) -> None:
        rec = self.tables[self.node_index[pod.node]]
        ready = rec.ready_at.get(pod.slot)
        now = self.clock.time()
        if ready is not None and ready <= now and rec.servable(pod.slot, now):
            pod.served_at = max(ready, pod.last_ask) - self.t0
            pod.first_ok = pod.first_ok if pod.first_ok is not None else True
            pod.wrong_identity = not self._own_identity(pod, rec)
            return
        if pod.first_ok is None:
            pod.first_ok = False
        backoff = min(CRASHLOOP_MAX, CRASHLOOP_FIRST * 2 ** (pod.attempts - 1))
        self._at(now - self.t0 + backoff, "ask", pod)

    def _own_identity(self, pod: Pod, rec: RecordingTable) -> bool:
        key = rec.access_key(pod.slot)
        call = self.issued.get(key) if key else None
        if call is None:
            self._index_calls()
            call = self.issued.get(key) if key else None
        if call is None or call.role_arn != BASE + pod.role:
            return False
        if self.sc.tag_keys == "eks":     # a session of its own, tagged with its UID
            return call.tags.get("kubernetes-pod-uid") == pod.uid
        return call.session_name == f"node-{pod.node}-{pod.role}"

    def _index_calls(self) -> None:
        for c in self.proxy.assume_role_calls(outcome="ok"):
            self.issued[c.access_key_id] = c

    # ---- the loop -----------------------------------------------------------------------
    async def settle(self) -> None:
        """Until every manager has settled for a few loop turns in a row (a woken timer
        takes several turns to become a call in flight)."""
        quiet = 0
        while quiet < 8:
            await asyncio.sleep(0)
            if all(m.settled or (slow is not None and m.schedule.blocked
                                 and m.schedule.inflight == slow.sleeping)
                   for m, slow in zip(self.managers, self.slow)):
                quiet += 1
            else:
                quiet = 0
                await asyncio.sleep(0.001)

    async def run(self) -> dict:
        sc = self.sc
        self.t0 = self.clock.time()
        self.node_index: dict[int, int] = {}
        self.issued: dict[str, object] = {}
        self.proxy.set_budget(sc.budget, sc.budget_burst)
        self._others_last = self.t0
        self.plan()
        end = self.t0 + sc.duration
        cpu0 = time.process_time()
        try:
            while self.clock.time() < end:
                now = self.clock.time()
                while self._events and self._events[0][0] <= now:
                    at, _, kind, what = heapq.heappop(self._events)
                    if kind == "node":
                        self.start_node(what)
                    elif kind == "bind":
                        self.bind(what)
                    elif kind == "ask":
                        self.ask(what)
                    elif kind == "judge":
                        self.judge(what)
                    else:
                        self.proxy.set_budget(what)
                await self.settle()
                self.other_callers(now)
                nxt = min(self._events[0][0] if self._events else end,
                          self.clock.next_deadline or end, now + 30.0, end)
                step = max(nxt - now, sc.quantum)
                if sc.others:         # their calls spread over time, not in lumps
                    step = sc.quantum
                self.clock.advance(step)
        finally:
            for m in self.managers:
                m.close()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for rec in self.tables:
                rec.table.close()
        return self.result(time.process_time() - cpu0)

    def other_callers(self, now: float) -> None:
        """The account's other STS callers, ``others`` calls/s against the same budget: the
        calls of the step that ends ``now``, after the fleet's calls at ``now`` (so they get
        what the fleet leaves: when the fleet keeps the budget empty, theirs are throttled
        as its own are)."""
        self._others_due += self.sc.others * (now - self._others_last)
        self._others_last = now
        calls = int(self._others_due)
        if not calls:
            return
        self._others_due -= calls
        taken = self.proxy.spend_budget(calls)
        row = self.others.setdefault(int(self.clock.time() - self.t0), [0, 0])
        row[0] += taken
        row[1] += calls - taken

    # ---- figures ------------------------------------------------------------------------
    def result(self, cpu: float) -> dict:
        sc = self.sc
        calls = self.proxy.assume_role_calls()
        times = [c.clock_at - self.t0 for c in calls]
        outcomes = [c.outcome for c in calls]
        per_second: dict[int, list[int]] = {}
        for t, o in zip(times, outcomes):
            row = per_second.setdefault(int(t), [0, 0])
            row[o != "ok"] += 1
        served = [p for p in self.pods if p.served_at is not None]
        first_calls = [p for p in self.pods if p.attempts]
        to_table = sorted(max(0.0, self.tables[self.node_index[p.node]].ready_at.get(
            p.slot, math.inf) - self.t0 - p.bound_at) for p in self.pods if p.slot >= 0)
        to_table = [x for x in to_table if math.isfinite(x)]
        peak = max((ok + th for ok, th in per_second.values()), default=0)
        budget_bound = sc.budget * sc.duration + (sc.budget_burst or sc.budget)
        second_half = sum(1 for t in times if t >= sc.duration / 2)
        issued: dict[tuple[str, str], list[float]] = {}
        for c, t in zip(calls, times):
            if c.outcome == "ok":
                issued.setdefault((c.role_arn, c.session_name), []).append(t)
        periods = [b - a for ts in issued.values() for a, b in zip(ts, ts[1:])]
        period = sum(periods) / len(periods) if periods else None
        late = [p for p in self.pods if sc.brownout and p.bound_at >= sc.brownout[0]]
        refreshing = set()
        if sc.brownout:       # keys issued before the brownout that were due during it
            start, end = sc.brownout[0], sc.brownout[0] + sc.brownout[1]
            before = {(c.role_arn, c.session_name) for c, t in zip(calls, times)
                      if c.outcome == "ok" and t < start}
            refreshing = {(c.role_arn, c.session_name) for c, t in zip(calls, times)
                          if start <= t < end} & before
        return {
            "scenario": asdict(sc),
            "pods": len(self.pods),
            "pods_served": len(served),
            "first_call_ok": sum(1 for p in self.pods if p.first_ok),
            "first_call_failed": sum(1 for p in self.pods if p.first_ok is False),
            "first_call_budget_allows": budget_allows(first_calls, sc),
            "attempts_max": max((p.attempts for p in served), default=0),
            "wrong_identity": sum(p.wrong_identity for p in self.pods),
            "pods_lost_credentials": len(self.lost),
            "sts_calls": len(calls),
            "sts_ok": outcomes.count("ok"),
            "sts_throttled": outcomes.count("throttle"),
            "sts_other": len(calls) - outcomes.count("ok") - outcomes.count("throttle"),
            "sts_ok_within_budget": outcomes.count("ok") <= budget_bound,
            "accepted_max_per_window": {
                str(w): most_in_window([t for t, o in zip(times, outcomes) if o == "ok"], w)
                for w in (1.0, 10.0)},
            "peak_calls_per_s": peak,
            "second_half_calls_per_s": round(second_half / (sc.duration / 2), 3),
            # keys / their mean time between issues: the steady rate, free of the waves a
            # short run's window cuts (sessions issued together are refreshed together)
            "refresh_period_s": round(period, 1) if period else None,
            "steady_calls_per_s": round(len(issued) / period, 3) if period else 0.0,
            "refreshes_in_brownout": len(refreshing),
            "late_pods": len(late),
            "late_first_call_ok": sum(1 for p in late if p.first_ok),
            "late_served": sum(1 for p in late if p.served_at is not None),
            "calls_per_s": {k: per_second[k] for k in sorted(per_second) if k < 60},
            "peak_over_budget": round(peak / sc.budget, 3),
            "throttled_share": round(outcomes.count("throttle") / len(calls), 4) if calls
            else 0.0,
            **self.others_figures(),
            "bound_to_table_s": _pcts(to_table),
            "bound_to_served_s": _pcts(sorted(p.served_at - p.bound_at for p in served)),
            "sim_cpu_s": round(cpu, 1),
        }


    def others_figures(self) -> dict:
        if not self.sc.others:
            return {}
        taken = sum(t for t, _ in self.others.values())
        throttled = sum(th for _, th in self.others.values())
        worst = max(self.others.values(), key=lambda r: r[1] / max(1, sum(r)))
        return {"others_calls": taken + throttled, "others_throttled": throttled,
                "others_throttled_seconds": sum(1 for _, th in self.others.values() if th),
                "others_worst_second_throttled": round(worst[1] / max(1, sum(worst)), 3),
                "others_per_s": {k: self.others[k] for k in sorted(self.others) if k < 60}}


def budget_allows(pods: list[Pod], sc: Scenario) -> int:
    """How many of these pods' first calls any schedule within the budget could serve: the
    keys (node, role) fetched earliest-deadline-first, one per token of a bucket of
    ``budget``/s and its burst, none before its first pod is bound.  (For unit jobs with
    release times EDF is optimal; a key serves every pod that asks after it is fetched.)
    The budget is taken as constant: during a brownout this overstates what it allows."""
    keys: dict[tuple[int, str], list[Pod]] = {}
    for p in pods:
        keys.setdefault((p.node, p.role), []).append(p)
    jobs = sorted((min(p.bound_at for p in ps), min(p.asks_at for p in ps), k)
                  for k, ps in keys.items())
    burst = sc.budget_burst or sc.budget
    patience = PATIENCE[sc.client]
    ready: list[tuple[float, tuple[int, str]]] = []
    fetched: dict[tuple[int, str], float] = {}
    t, tokens, i, last = 0.0, burst, 0, 0.0
    while i < len(jobs) or ready:
        if not ready:
            t = max(t, jobs[i][0])
        while i < len(jobs) and jobs[i][0] <= t:
            heapq.heappush(ready, (jobs[i][1], jobs[i][2]))
            i += 1
        tokens = min(burst, tokens + (t - last) * sc.budget)
        last = t
        if tokens < 1.0 - 1e-9:                   # (a float step might not move t)
            t += max((1.0 - tokens) / sc.budget, 1e-6)
            continue
        deadline, key = heapq.heappop(ready)
        if deadline != math.inf and deadline + patience - sc.sts_latency < t:
            heapq.heappush(ready, (math.inf, key))   # too late for its first pod: last
            continue
        tokens -= 1.0
        fetched[key] = t
    return sum(1 for k, ps in keys.items() for p in ps
               if fetched[k] + sc.sts_latency <= p.asks_at + patience)


def most_in_window(times: list[float], window: float) -> int:
    """The most of these instants within any half-open ``window`` of time."""
    times = sorted(times)
    best = lo = 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _pcts(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "max": None}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": round(pick(0.5), 2), "p99": round(pick(0.99), 2), "max": round(xs[-1], 2)}


@contextlib.contextmanager
def sandbox(pool: int = 32, attempts: int = 1):
    """moto + the budget proxy on a manual clock + one STS client, static credentials."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchutil import aws_env
    for name, level in (("werkzeug", logging.ERROR), ("kiamfast.audit", logging.WARNING),
                        ("kiamfast.credentials", logging.ERROR)):
        logging.getLogger(name).setLevel(level)
    clock = ManualClock()
    with aws_env(), MotoSts() as moto, FaultProxy(moto.url, clock=clock.time) as proxy, \
            tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm")
                                        else None) as tmp:
        # time is simulated: a call moto answers slowly on a loaded machine is not a timeout
        sts = StsClient(endpoint_url=proxy.url, max_pool_connections=pool,
                        max_attempts=attempts, read_timeout=300.0)
        try:
            yield proxy, sts, clock, tmp
        finally:
            sts.close()


def simulate(sc: Scenario) -> dict:
    with sandbox(attempts=sc.sts_attempts) as (proxy, sts, clock, tmp):
        started = time.monotonic()
        result = asyncio.run(Fleet(sc, proxy, sts, clock, tmp).run())
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return result


# ---- the scenarios ----------------------------------------------------------------------

def arrival(nodes: int = 2000, budget: float = 600.0, **kw) -> Scenario:
    """2,000 nodes Ready within 10 s, 8 pods each, 5 roles per node out of 50."""
    return Scenario(nodes=nodes, budget=budget, account_qps=budget, **kw)


def todays_defaults(sc: Scenario) -> Scenario:
    return replace(sc, account_qps=0.0, qps=5.0, burst=20, sts_attempts=2)


def steady(nodes: int = 10000, budget: float = 600.0, hours: float = 2.0, **kw) -> Scenario:
    """Nodes × 5 roles long after arrival: the refresh rate against the budget."""
    kw.setdefault("pods_per_node", 5)
    return Scenario(nodes=nodes, budget=budget, account_qps=budget,
                    window=600.0, pull=(5.0, 20.0), duration=hours * 3600, **kw)


def brownout(nodes: int = 2000, budget: float = 600.0, fraction: float = 0.1,
             **kw) -> Scenario:
    """STS at ``fraction`` of its rate for 10 minutes from 30 min in, when the first
    refreshes (at about half-life of the 1 h sessions) are due; a tenth of the nodes join
    during it."""
    return Scenario(nodes=nodes, budget=budget, account_qps=budget, window=600.0,
                    duration=2 * 3600, brownout=(1800.0, 600.0, fraction),
                    late_nodes=nodes // 10, **kw)


def runs(quick: bool) -> list[tuple[str, Scenario]]:
    """The issue's scenarios: arrival at its scale (2,000 nodes Ready within 10 s, 600/s);
    the brownout and the steady state, which run for hours of simulated time, with nodes and
    the budget scaled together (the same share per node: 200 nodes at 60/s, 1,000 at 60/s
    for 10,000 at 600/s); the Go SDK at 500 nodes and 150/s; the account's other callers
    during the arrival.  ``quick``: 50 nodes at 15/s: arrival (alone and beside the other
    callers) and brownout."""
    if quick:
        return [("arrival", arrival(nodes=50, budget=15.0)),
                ("arrival, other callers at 10 %",
                 replace(arrival(nodes=50, budget=15.0), others=1.5, duration=40.0)),
                ("brownout 10 % for 10 min", brownout(nodes=50, budget=15.0))]
    arr = arrival(nodes=2000, budget=600.0)
    return [("arrival", arr), ("arrival, today's defaults", todays_defaults(arr)),
            ("arrival, the account's other callers at 10 % of it",
             replace(arr, others=60.0, duration=60.0)),
            ("arrival, Go SDK (500 nodes at 150/s)",
             replace(arrival(nodes=500, budget=150.0), client="go")),
            ("brownout 10 % for 10 min (200 nodes at 60/s)",
             brownout(nodes=200, budget=60.0)),
            ("steady state, 1 h (1,000 nodes at 60/s: 10,000 at 600/s per node)",
             steady(nodes=1000, budget=60.0, hours=1.0))]


# ---- the per-node cost ------------------------------------------------------------------------

FOOTPRINT_FLAGS = {
    "defaults": [],
    "--sts-account-qps=600 --sts-fleet-nodes=2000": ["--sts-account-qps=600",
                                                     "--sts-fleet-nodes=2000"],
    "--sts-account-qps=600 (nodes from the API)": ["--sts-account-qps=600"],
}


def footprint(flags: list[str], *, pods: int = 110, roles: int = 40,
              events: int = 2000) -> dict:
    """One real agent (supervisor, control process, a worker) on the emulator's node with
    ``pods`` pods over ``roles`` roles: RSS when ready, and the control process's CPU per
    1,000 pod events (pods replaced, each with its role: acquire, prefetch, release)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_agent as ba
    from benchutil import cpu_seconds, pod_addresses, rss_bytes
    from scale_sim import _drive_events, _wait_agent_view

    with ba.cluster() as c:
        ips = pod_addresses(pods)
        for i, ip in enumerate(ips):
            c.add_pod(ip, ba.role_name(i % roles))
        with ba.agent(c, extra=flags) as a:
            a.wait_ready(120)
            procs = a.processes()
            rss = sum(rss_bytes(p) for p in a.all_pids())
            control = procs["control"][0]
            cpu0 = cpu_seconds(control)
            n = _drive_events(c, ips, roles=roles, events=events)
            processed = _wait_agent_view(c, a, ips, timeout=120)
            cpu = cpu_seconds(control) - cpu0
            return {"rss_mb": round(rss / 2**20, 1), "events": n, "processed": processed,
                    "control_cpu_per_1k_events_s": round(cpu / n * 1000, 3)}


def footprint_markdown(rows: list[tuple[str, dict]]) -> str:
    out = ("| agent flags | RSS at ready (all processes) MB | control CPU s per 1,000 pod "
           "events |\n|---|---|---|\n")
    return out + "".join(f"| {name} | {r['rss_mb']} | {r['control_cpu_per_1k_events_s']} |\n"
                         for name, r in rows)


def markdown(results: list[tuple[str, dict]]) -> str:
    head = ("| scenario | nodes × pods | budget /s | STS ok / throttled (% of calls) | peak /s "
            "(÷ budget) | first calls ok (budget allows) | served | wrong identity | lost creds "
            "| bound → table p50 / p99 / max s | refresh calls/s (÷ budget) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for name, r in results:
        sc = r["scenario"]
        t = r["bound_to_table_s"]
        rows.append(
            f"| {name} | {sc['nodes']} × {sc['pods_per_node']} ({sc['roles_per_node']} of "
            f"{sc['role_pool']} roles) | {sc['budget']:g} | {r['sts_ok']} / "
            f"{r['sts_throttled']} ({r['throttled_share']:.1%}) | {r['peak_calls_per_s']} "
            f"({r['peak_over_budget']:.2f}) | {r['first_call_ok']} / "
            f"{r['pods']} ({r['first_call_budget_allows']}) | {r['pods_served']} | "
            f"{r['wrong_identity']} | {r['pods_lost_credentials']} | {t['p50']} / {t['p99']} "
            f"/ {t['max']} | {_share(r.get('steady_calls_per_s'), sc['budget'])} |")
    notes = [f"\n{name}: the account's other STS callers, {r['scenario']['others']:g} calls/s "
             f"steady, had {r['others_throttled']:,} of {r['others_calls']:,} calls throttled "
             f"({r['others_throttled'] / max(1, r['others_calls']):.1%}), in "
             f"{r['others_throttled_seconds']} seconds of the run (worst second: "
             f"{r['others_worst_second_throttled']:.0%} of theirs).\n"
             for name, r in results if r.get("others_calls")]
    return head + "\n".join(rows) + "\n" + "".join(notes)


def _share(rate: float | None, budget: float) -> str:
    return f"{rate:.2f} ({rate / budget:.1%})" if rate else "—"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=("arrival", "today", "steady", "brownout",
                                           "footprint"),
                    default="arrival")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--budget", type=float, default=600.0)
    ap.add_argument("--burst", type=int, help="--sts-burst of every node")
    ap.add_argument("--client", choices=tuple(PATIENCE), default="botocore")
    ap.add_argument("--hours", type=float, default=2.0, help="steady: simulated hours")
    ap.add_argument("--fraction", type=float, default=0.1,
                    help="brownout: STS's rate during it, a fraction of the budget")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pods-per-node", type=int, help="pods of each node (roles stay 5)")
    ap.add_argument("--tag-keys", choices=("kiamfast", "eks"),
                    help="--session-tags with these keys (eks: one session per pod)")
    args = ap.parse_args(argv)
    kw = {"client": args.client, "seed": args.seed}
    if args.pods_per_node:
        kw["pods_per_node"] = args.pods_per_node
    if args.tag_keys:
        kw["tag_keys"] = args.tag_keys
    if args.burst:
        kw["burst"] = args.burst
    if args.nodes:
        kw["nodes"] = args.nodes
    if args.scenario == "footprint":
        print(json.dumps({name: footprint(flags) for name, flags in FOOTPRINT_FLAGS.items()}))
        return 0
    if args.scenario in ("arrival", "today"):
        sc = arrival(budget=args.budget, **kw)
        if args.scenario == "today":
            sc = todays_defaults(sc)
    elif args.scenario == "steady":
        sc = steady(budget=args.budget, hours=args.hours, **kw)
    else:
        sc = brownout(budget=args.budget, fraction=args.fraction, **kw)
    print(json.dumps(simulate(sc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
