"""The credential manager: which STS sessions exist, and where their credentials live.

The control process is the only place that talks to STS. A pod with a role is acquired (often
before it has an IP) and the manager starts fetching at once (prefetch), so the table holds
ready-to-send bytes before the pod's SDK asks.  While a live pod uses them, credentials are
refreshed ahead of time (half-life, jittered), and what workers serve always has at least
``min_lifetime`` left (sdk-imds.md §4: SDKs misbehave below ~15 min). If STS is down, the old
credentials keep flowing until that point; then the slot turns to ERROR and workers answer
503.  Keys and session names: :mod:`.keys`; when calls run and the node's STS budget:
:mod:`.schedule`; one STS call and what its answer does to the key (retries, refusals,
expiry): :mod:`.calls`; which key holds which slot, and adoption: :mod:`.slots`; what an
answer writes and logs, and when the key is called next: :mod:`.outcomes`; the bytes
written: :mod:`.render`.  This module keeps the keys' life: which pods use which key, the
order their calls go in, idle keys freed, a restart's slots adopted.

Restarts. Every slot also holds its key and expiry (``render.PART_KEY``), so a restarted
control process adopts what the table holds (:meth:`CredentialManager.adopt`): credentials
still servable keep being served, to the same slots, and are refreshed on their old schedule
instead of calling STS for every key at once (or losing them when STS is down). A slot is
never freed, and so never reused for another key, while an address in the table names it
(``slot_refs``, counted where the addresses are written).

What it must never do: hand a key's credentials to a slot of another key, or call STS twice
at once for one key.

Time comes from the injected ``clock`` (epoch seconds) and ``sleep``, so tests can live
through hours of rotation without waiting. The table is any object with ``write_cred``,
``set_cred_state`` and ``clear_cred`` (``kiamfast.table.Table`` in production).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from kiamfast.control.iam.calls import AssumeRole, KeyCalls
from kiamfast.control.iam.keys import (CredentialKey, CredentialRequest, SessionNaming,
                                       tag_problem)
from kiamfast.control.iam.metrics import StsMetrics
from kiamfast.control.iam.outcomes import CallTiming, audit_line
from kiamfast.control.iam.schedule import (HEADROOM, PRIO_NEW, PRIO_REFRESH, PRIO_WANTED,
                                           PROBE_AFTER, Schedule, node_bucket)
from kiamfast.control.iam.slots import (DENIED, READY, STATES, CredentialTable, KeyEntry,
                                        NoRefs, SlotPool, SlotRefs)
from kiamfast.control.iam.sts import StsDenied, StsThrottled
from kiamfast.table import CRED_PENDING

if TYPE_CHECKING:
    from kiamfast.config import Config

log = logging.getLogger("kiamfast.credentials")


class ManagerClosed(Exception):
    """The manager was closed; it takes no more work."""


class CredentialManager:
    """Prefetch, refresh and publish STS credentials for the pods of one node."""

    def __init__(self, *, table: CredentialTable, sts: AssumeRole, capacity: int,
                 naming: SessionNaming | None = None,
                 notify: Callable[[], Any] = lambda: None,
                 base_role_arn: str | None = None,
                 duration: float = 3600.0, min_lifetime: float = 900.0,
                 refresh_fraction: float = 0.5, refresh_jitter: float = 0.1,
                 qps: float = 5.0, burst: int = 20, max_inflight: int = 8,
                 account_qps: float = 0.0, fleet_nodes: int = 0,
                 error_ttl: float = 0.0, error_ttl_floor: float = 5.0,
                 error_ttl_max: float = 60.0,
                 backoff_base: float = 1.0, backoff_max: float = 30.0,
                 throttle_base: float = 1.0, throttle_max: float = 30.0,
                 release_grace: float = 120.0, slot_refs: SlotRefs | None = None,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 rng: random.Random | None = None, **naming_args: Any):
        if min_lifetime >= duration:
            raise ValueError("min_lifetime must be shorter than the session duration")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.naming = naming or SessionNaming(**naming_args)
        self.table = table
        self.capacity = capacity
        self.notify = notify
        self.duration = int(duration)
        self.min_lifetime = float(min_lifetime)
        self.release_grace = release_grace
        self.clock = clock
        self.rng = rng or random.Random()
        error_ttl = max(float(error_ttl), error_ttl_floor)
        self.timing = CallTiming(refresh_fraction=refresh_fraction,
                                 refresh_jitter=refresh_jitter, error_ttl=error_ttl,
                                 error_ttl_max=max(error_ttl, error_ttl_max),
                                 backoff_base=backoff_base, backoff_max=backoff_max,
                                 rng=self.rng)
        self.account_qps = account_qps
        fleet = account_qps > 0
        self.bucket = node_bucket(qps=qps, burst=burst, account_qps=account_qps,
                                  fleet_nodes=fleet_nodes, clock=clock, sleep=sleep)
        # The calls need the schedule and the schedule runs them: built just below.
        self.schedule = Schedule(bucket=self.bucket, max_inflight=max_inflight,
                                 fetch=lambda entry, ticket: self.calls.fetch(entry, ticket),
                                 on_timer=self._on_timer, clock=clock, sleep=sleep,
                                 probe_after=PROBE_AFTER if fleet else 0.0,
                                 headroom=HEADROOM if fleet else 0.0,
                                 throttle_base=throttle_base, throttle_max=throttle_max,
                                 rng=self.rng)
        self.slots = SlotPool(table=table, capacity=capacity,
                              slot_refs=slot_refs if slot_refs is not None else NoRefs())
        self.metrics = StsMetrics()
        self.metrics.rate.set(self.bucket.rate)
        self.calls = KeyCalls(sts=sts, naming=self.naming, table=table, schedule=self.schedule,
                              timing=self.timing, metrics=self.metrics,
                              duration=self.duration, min_lifetime=self.min_lifetime,
                              base_role_arn=base_role_arn or None,
                              release_grace=release_grace, clock=clock, rng=self.rng,
                              notify=self._notify, set_waiting=self._set_waiting)
        self._pods: dict[str, CredentialKey] = {}   # pod UID -> the key it uses
        self._waiting: set[KeyEntry] = set()        # entries with waiting=True
        self._closed = False
        self._stopped = asyncio.Event()
        self._counts = {"cache_hits": 0, "evicted": 0}

    @classmethod
    def from_config(cls, config: Config, *, table: CredentialTable, sts: AssumeRole,
                    notify: Callable[[], Any], fleet_nodes: int | None = None,
                    **overrides: Any) -> "CredentialManager":
        """Build from the configuration and the table (``kiamfast.table.Table``).
        ``fleet_nodes`` (e.g. the node count from the API) overrides ``--sts-fleet-nodes``."""
        kwargs: dict[str, Any] = dict(
            table=table, sts=sts, notify=notify,
            capacity=table.layout["cred_capacity"],
            node_name=config.node, base_role_arn=config.base_role_arn or None,
            session_policy=config.session_name_policy,
            session_tags=config.session_tags,
            tag_keys=config.session_tag_keys, cluster_name=config.cluster_name,
            duration=config.session_duration,
            min_lifetime=config.min_credential_lifetime,
            qps=config.sts_qps, burst=config.sts_burst,
            account_qps=config.sts_account_qps,
            fleet_nodes=config.sts_fleet_nodes if fleet_nodes is None else fleet_nodes,
            error_ttl=config.iam_role_error_ttl,
            max_inflight=getattr(sts, "max_workers", 8))   # one call per thread of its pool
        kwargs.update(overrides)
        return cls(**kwargs)

    def set_fleet_nodes(self, nodes: int) -> None:
        """The number of agents sharing ``account_qps`` is now ``nodes`` (the cluster's node
        count): the floor throttling may cut this node's rate down to follows its share."""
        if self.account_qps <= 0 or nodes < 1:
            return
        before = self.bucket.min_rate
        share = self.schedule.share_fleet(self.account_qps, nodes)
        if share != before:
            log.info("STS share: %.3g calls/s (%g over %d nodes)", share, self.account_qps,
                     nodes)
        self.metrics.rate.set(self.bucket.rate)

    # ---- the pods' API ------------------------------------------------------------------------

    def acquire(self, pod_uid: str, req: CredentialRequest) -> int:
        """Credential slot for a pod; allocates it and starts a prefetch on first use.

        Idempotent: the same pod and key give the same slot (what the request says of the
        pod, e.g. its address, is refreshed). A pod whose request maps to another key (its
        role annotation changed) leaves its old key first.
        Raises CredentialSlotsExhausted when every slot is in use by a live key.
        """
        if self._closed:
            raise ManagerClosed("credential manager is closed")
        key = self.naming.key_for(req, pod_uid)
        old = self._pods.get(pod_uid)
        if old is not None:
            if old == key:
                entry = self.slots.by_key[key]
                entry.users[pod_uid] = req
                self.schedule.sooner(entry, addressed=bool(req.pod_ip))
                return entry.slot
            self.release(pod_uid)
        entry = self.slots.by_key.get(key)
        if entry is not None:
            self._counts["cache_hits"] += 1
            self.metrics.cache_hit(key.role_arn)
            entry.users[pod_uid] = req
            self._pods[pod_uid] = key
            if entry.idle_since is not None:
                self._revive(entry)
            if entry.creds is not None and entry.state == READY:
                audit_line("credentials shared", entry, pods=[(pod_uid, req)],
                           session_name=self.calls.session_name(entry))
            self.schedule.sooner(entry, addressed=bool(req.pod_ip))
            return entry.slot
        entry = self.slots.allocate(key, evict=self._evict)
        slot = entry.slot
        entry.users[pod_uid] = req
        self.schedule.sooner(entry, addressed=bool(req.pod_ip))
        self._pods[pod_uid] = key
        problem = tag_problem(key.tags)
        if problem:
            # Never sent without the tag or with another value: no credentials for this key.
            log.warning("pod %s/%s: no credentials for %s: %s", req.namespace, req.pod_name,
                        key.role_arn, problem)
            entry.unsendable = True
            self.calls.failed(entry, StsDenied("InvalidSessionTag", problem,
                                               role_arn=key.role_arn))
            return slot
        self.table.write_cred(slot, [], serve_until=0.0, state=CRED_PENDING)
        self._notify()
        self.schedule.enqueue(entry, PRIO_NEW)
        return slot

    def release(self, pod_uid: str) -> None:
        """A pod is gone (or no longer uses its key). The last user gone stops refreshing;
        the slot is freed after ``release_grace`` unless a pod takes the key up again."""
        key = self._pods.pop(pod_uid, None)
        entry = self.slots.by_key.get(key) if key is not None else None
        if entry is None:
            return
        entry.users.pop(pod_uid, None)
        if not entry.users:
            self._set_waiting(entry, False)     # nobody waits for a key nobody uses
            entry.idle_since = self.clock()
            self.schedule.set_timer(entry, entry.idle_since + self.release_grace, "free")

    def wanted(self, slot: int) -> None:
        """A worker has a request for this slot and could not serve it: the key is waited
        for (first in the queue, through its retries), and tried now unless a call is in
        flight or the key is backing off."""
        entry = self.slots.by_slot.get(slot)
        if entry is None or entry.freed or entry.idle_since is not None:
            return
        now = self.clock()
        if entry.state == DENIED or (entry.state == READY and now < entry.serve_until):
            return  # servable from our point of view; the worker's read was stale
        if not entry.waiting:
            entry.asked_at = now
        self._set_waiting(entry, True)
        if entry.inflight or (now < entry.not_before
                              and not isinstance(entry.last_error, StsThrottled)):
            return
        entry.quick_retry = True
        self.schedule.enqueue(entry, PRIO_WANTED)

    # ---- a restart, and what a slot holds -----------------------------------------------------

    def adopt(self, slots: Iterable[tuple[int, int, float, list[bytes]]]) -> int:
        """A restarted control process: take over what a previous one left in the table, as
        ``(slot, state, serve_until, parts)`` for every slot.  Servable credentials and
        error documents become entries of their key (idle until a pod acquires them, freed
        after ``release_grace`` otherwise); every other slot that holds anything is kept out
        of allocation until no address names it (:meth:`reclaim`).  Returns how many keys
        were adopted."""
        now = self.clock()
        adopted = self.slots.adopt(slots, now=now, refresh_time=self.timing.refresh_at)
        for entry in adopted:
            self.schedule.set_timer(entry, now + self.release_grace, "free")
        if adopted or self.slots.held:
            log.info("adopted %d credential keys from the table (%d slots held until free)",
                     len(adopted), self.slots.held)
        return len(adopted)

    def reclaim(self) -> None:
        """Free the held slots that no address names any more (call after commits)."""
        self.slots.reclaim()

    def role_of_slot(self, slot: int) -> tuple[str, str | None] | None:
        """(role ARN, external ID) of the key a slot holds (an adopted one included)."""
        entry = self.slots.by_slot.get(slot)
        return None if entry is None else (entry.key.role_arn, entry.key.external_id)

    # ---- life cycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the schedule until :meth:`close`."""
        runner = asyncio.create_task(self.schedule.run())
        stop = asyncio.create_task(self._stopped.wait())
        try:
            done, _ = await asyncio.wait([runner, stop], return_when=asyncio.FIRST_COMPLETED)
            if runner in done:
                runner.result()   # a scheduler bug: let the supervisor see it
        finally:
            self.schedule.close()
            stop.cancel()
            await asyncio.gather(runner, stop, return_exceptions=True)

    def close(self) -> None:
        """Stop scheduling; in-flight calls are abandoned. The STS client is the caller's."""
        self._closed = True
        self._stopped.set()

    @property
    def settled(self) -> bool:
        """Nothing in flight and nothing that could start before time moves on."""
        return self.schedule.settled

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until :attr:`settled` (tests and benchmarks)."""
        async def _wait() -> None:
            while not self.settled:
                await asyncio.sleep(0.002)
        await asyncio.wait_for(_wait(), timeout)

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        states = {s: 0 for s in STATES}
        idle = 0
        for e in self.slots.by_key.values():
            states[e.state] += 1
            idle += e.idle_since is not None
        calls = self.calls.counts
        return {
            **calls,
            **self._counts,
            "sts_calls": sum(calls[k] for k in ("sts_success", "sts_throttled",
                                                "sts_transient", "sts_denied")),
            "inflight": self.schedule.inflight,
            "keys": len(self.slots.by_key),
            "pods": len(self._pods),
            "idle_keys": idle,
            "slots_free": self.slots.free,
            "slots_held": self.slots.held,
            "queued": self.schedule.queued,
            "waiting_keys": len(self._waiting),
            "rate_limit": self.bucket.rate,
            "throttle_paused_for": max(0.0, self.bucket.paused_until - self.clock()),
            **{f"keys_{s}": n for s, n in states.items()},
        }

    def describe(self, slot: int) -> dict[str, Any] | None:
        """Debug view of one slot (no secrets)."""
        entry = self.slots.by_slot.get(slot)
        return None if entry is None else entry.describe()

    # ---- a key's life -------------------------------------------------------------------------

    def _evict(self, entry: KeyEntry) -> None:
        """Every slot is taken: the idle key the pool chose gives its slot up."""
        self._counts["evicted"] += 1
        self._free_entry(entry)

    def _free_entry(self, entry: KeyEntry) -> None:
        if entry.freed:
            return
        if self.slots.named(entry.slot):
            # An address still points here (a restart before the model caught up, or a
            # release not yet committed): freeing now could hand it to another key.
            self.schedule.set_timer(entry, self.clock() + 1.0, "free")
            return
        entry.freed = True
        self._set_waiting(entry, False)
        self.schedule.dequeue(entry)
        self.slots.remove(entry)
        if not self.slots.has_role(entry.key.role_arn):
            self.metrics.forget_role(entry.key.role_arn)
        self._notify()

    def _revive(self, entry: KeyEntry) -> None:
        entry.idle_since = None
        entry.due, entry.addressed = float("inf"), False   # its new pods' (sooner)
        self.schedule.cancel_timer(entry)     # the "free" timer
        now = self.clock()
        if entry.inflight:
            return
        if entry.state == READY and now < entry.serve_until:
            if entry.refresh_at <= now:
                self.schedule.enqueue(entry, PRIO_REFRESH)
            else:
                self.schedule.set_timer(entry, entry.refresh_at, "fetch", PRIO_REFRESH)
        elif now >= entry.not_before:
            self.schedule.enqueue(entry, PRIO_NEW)
        else:
            self.schedule.set_timer(entry, entry.not_before, "fetch", PRIO_NEW)

    def _set_waiting(self, entry: KeyEntry, waiting: bool) -> None:
        entry.waiting = waiting
        entry.quick_retry = entry.quick_retry and waiting
        (self._waiting.add if waiting else self._waiting.discard)(entry)
        self.metrics.waiting.set(len(self._waiting))

    def _on_timer(self, entry: KeyEntry, kind: str) -> None:
        if kind == "free":
            if entry.idle_since is not None and not entry.users:
                self._free_entry(entry)
        elif kind == "expire":
            self.calls.expire(entry)

    # ---- side channels ------------------------------------------------------------------------

    def _notify(self) -> None:
        try:
            self.notify()
        except Exception:  # a broken notifier must not break the manager
            log.exception("notify callback failed")
