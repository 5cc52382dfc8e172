"""The credential manager: which STS sessions exist, when they are fetched, where they live.

The control process is the only place that talks to STS. This module decides *when*: a pod
with a role is reported by the watch (often before it has an IP) and the manager starts
fetching at once (prefetch), so the table holds ready-to-send bytes before the pod's SDK asks.
While a live pod uses them, credentials are refreshed ahead of time (half-life, jittered), and
what workers serve always has at least ``min_lifetime`` left (sdk-imds.md §4: SDKs misbehave
below ~15 min). If STS is down, the old credentials keep flowing until that point; then the
slot turns to ERROR and workers answer 503.

Credential key. Credentials are shared by every pod whose AssumeRole call would be the same:
``(role ARN, external ID, session-name policy value, session tags)``. Never the role alone:
kube2iam keyed by role only and handed one pod's external-ID session to another (#98).

Session-name policies (``session_policy``):

* ``node-role`` (default): ``<node>-<role name>``; one session per role and node, pods are
  traced to access keys through the audit log (``kiamfast.audit``, one line per issued
  credential and per pod that joins one).
* ``pod``: ``<namespace>.<pod>``; one session per pod, CloudTrail names the pod, more calls.
* ``kube2iam``: ``<fnv32a hex of the pod IP>-<role name>``, kube2iam's format, one session
  per role as kube2iam (but keyed with the external ID too). Compromise: kube2iam named the
  session after whichever pod asked first, at request time; kiamfast fetches before a pod
  asks and often before it has an IP, so the name uses the IP of the first user that has one
  and otherwise fnv32a of that pod's UID.

Optional session tags (``session_tags``: names of the chosen set, or ``True`` for all) are
sent for ABAC and become part of the key, so tagging per pod means one session per pod.
Two sets (``tag_keys``): ``kiamfast`` (``kiamfast-namespace``, ``kiamfast-pod``,
``kiamfast-serviceaccount``, ``kiamfast-node``, ``kiamfast-cluster``) and ``eks``, EKS Pod
Identity's keys (``eks-cluster-name``, ``kubernetes-namespace``,
``kubernetes-service-account``, ``kubernetes-pod-name``, ``kubernetes-pod-uid``), transitive
as EKS sends them, so policies written for ``aws:PrincipalTag/kubernetes-namespace`` work
unchanged; the cluster tag only when ``cluster_name`` is set.  With ``eks`` every pod has
its own session, named as EKS names it: ``eks-<cluster>-<pod>-<uid prefix>`` (the
session-name policy does not apply).
A tag value STS cannot take (length, characters) is never altered or left out, since a
policy condition may rely on it: that pod's key is denied (``InvalidSessionTag``) without an
STS call.  A tagged call STS refuses is denied as any refusal, with a message naming
``sts:TagSession``, and never retried without its tags.

Scheduling. One STS call per key at a time (single flight); every call takes a token from a
global bucket (``qps``/``burst``); a throttled call pauses the bucket (jittered
exponential, it is account-wide) and halves its rate (AIMD, ``kiamfast/budget.py``), successes
give rate back; with a fleet budget the rate never drops below this node's share of it
(:func:`node_share`), which every node may always use. The throttled key itself retries
when the pause ends, with no backoff of its own (the node's rate is what throttling is
about). Other failures back off per key. Calls
are taken from a priority queue: a key a pod is *waiting* for (a worker said so) beats
prefetching new keys, which beats refresh-ahead, and keeps that priority through its
retries until it is servable.  A worker holds a pod's request only for its wait budget
(0.35 s), so a waited-for key does not wait for the node's token or pause: it borrows a
token (debt of at most a burst, which later tokens pay back: over time the node's rate
holds), and a throttled call of it retries once 50-150 ms later, within that wait.  The pod's
SDK paces anything more: a key is waited for again only when a pod asks again.
Permanent refusals (AccessDenied...) become the real-IMDS error document, cached for
``error_ttl`` (kube2iam's ``--iam-role-error-ttl``, at least ``error_ttl_floor`` so a
misconfigured role cannot hammer STS), retried with growing intervals while pods use them.

Restarts. Every slot also holds its key and expiry (``render.PART_KEY``), so a restarted
control process adopts what the table holds (:meth:`adopt`): credentials still servable keep
being served, to the same slots, and are refreshed on their old schedule instead of calling
STS for every key at once (or losing them when STS is down). A slot is never freed, and so
never reused for another key, while an address in the table names it (``slot_in_use``).

What it must never do: serve credentials with less than ``min_lifetime`` left, hand a key's
credentials to a slot of another key, call STS twice at once for one key, log a secret, or
block the event loop (STS runs on the client's thread pool).

Time comes from the injected ``clock`` (epoch seconds) and ``sleep``, so tests can live
through hours of rotation without waiting. The table is any object with ``write_cred``,
``set_cred_state`` and ``clear_cred`` (``kiamfast.table.Table`` in production).
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import heapq
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Protocol

from kiamfast.config import tag_value_problem
from kiamfast.control import render
from kiamfast.budget import TokenBucket, backoff
from kiamfast.control.sts import (Credentials, StsDenied, StsError, StsThrottled,
                                  StsTransient, classify, sanitize_session_name)

log = logging.getLogger("kiamfast.credentials")
audit = logging.getLogger("kiamfast.audit")

# Table credential states (the values of kiamfast.table.CRED_*; checked by the tests).
CRED_EMPTY, CRED_PENDING, CRED_READY, CRED_ERROR = 0, 1, 2, 3

SESSION_POLICIES = ("node-role", "pod", "kube2iam")
TAG_NAMESPACE = "kiamfast-namespace"
TAG_POD = "kiamfast-pod"
TAG_SERVICE_ACCOUNT = "kiamfast-serviceaccount"
TAG_NODE = "kiamfast-node"
TAG_CLUSTER = "kiamfast-cluster"
SESSION_TAGS = (TAG_NAMESPACE, TAG_POD, TAG_SERVICE_ACCOUNT, TAG_NODE)
# EKS Pod Identity's keys (its user guide, "List of session tags added by EKS Pod
# Identity"); eks-cluster-arn is not sent: outside EKS there is no such cluster to name.
EKS_CLUSTER = "eks-cluster-name"
EKS_TAGS = ("kubernetes-namespace", "kubernetes-service-account", "kubernetes-pod-name",
            "kubernetes-pod-uid")
TAG_KEYS = ("kiamfast", "eks")
TAGSESSION_HINT = ("session tags are sent: the role's trust policy must allow "
                   "sts:TagSession as well as sts:AssumeRole")

# Queue priorities (lower first).
PRIO_WANTED = 0     # a worker has a request waiting for this slot
PRIO_NEW = 1        # prefetch of a key nobody has credentials for yet, or its retry
PRIO_REFRESH = 2    # refresh-ahead of credentials still being served

# A throttled call of a key a pod's request is held for retries once this soon (seconds):
# within the worker's wait budget (0.35 s by default), and spread so retries do not align.
QUICK_RETRY = (0.05, 0.15)

# Far enough that an error document is never reported EXPIRED by the table; it is replaced
# by the next attempt anyway.
_ERROR_DOC_LIFETIME = 365 * 86400.0
_STS_BUCKETS = tuple(0.001 * 2 ** i for i in range(14))  # kube2iam: 1 ms x2, 14 buckets


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


class CredentialSlotsExhausted(Exception):
    """Every credential slot of the table is used by a live key."""


class ManagerClosed(Exception):
    """The manager was closed; it takes no more work."""


class CredentialTable(Protocol):
    def write_cred(self, slot: int, parts: list[bytes], *, serve_until: float,
                   state: int) -> None: ...
    def set_cred_state(self, slot: int, state: int, serve_until: float | None = None) -> None: ...
    def clear_cred(self, slot: int) -> None: ...


class AssumeRole(Protocol):
    async def assume_role(self, role_arn: str, session_name: str, *,
                          external_id: str | None = None, duration: int = 3600,
                          tags: list[tuple[str, str]] | None = None,
                          transitive: bool = False) -> Credentials: ...


@dataclass(frozen=True)
class CredentialRequest:
    """What the watcher knows about a pod that needs credentials."""
    role_arn: str
    external_id: str | None = None
    namespace: str = ""
    pod_name: str = ""
    service_account: str = ""
    pod_ip: str | None = None


@dataclass(frozen=True)
class CredentialKey:
    """Everything that makes two AssumeRole calls different. Equal keys share a slot."""
    role_arn: str
    external_id: str | None
    session: str                          # the session-name policy value
    tags: tuple[tuple[str, str], ...] = ()


def fnv32a(data: str | bytes) -> int:
    """32-bit FNV-1a (Go's hash/fnv New32a), used by kube2iam for session names."""
    h = 0x811C9DC5
    for b in data.encode() if isinstance(data, str) else data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def tag_problem(tags: Iterable[tuple[str, str]]) -> str:
    """Why STS would refuse these session tags, or "" when it takes them all."""
    for key, value in tags:
        problem = tag_value_problem(value)
        if problem:
            return f"session tag {key}={value[:64]!r}: {problem}"
    return ""


# ---- per-key state ------------------------------------------------------------------------------

_PENDING, _READY, _ERROR, _DENIED = "pending", "ready", "error", "denied"


@dataclass(eq=False)
class _Entry:
    key: CredentialKey
    slot: int
    users: dict[str, CredentialRequest] = field(default_factory=dict)  # pod UID -> request
    state: str = _PENDING
    creds: Credentials | None = None
    serve_until: float = 0.0
    fetched_at: float = 0.0
    refresh_at: float = 0.0
    failures: int = 0              # consecutive failed attempts
    denials: int = 0               # consecutive permanent refusals
    not_before: float = 0.0        # backoff: no attempt before this (except refresh-ahead)
    last_error: StsError | None = None
    inflight: bool = False
    queued: int | None = None      # priority it is queued with, None if not queued
    timer: int = 0                 # version of the one live timer; older timers are ignored
    timer_prio: int = PRIO_NEW     # queue priority when a "fetch" timer fires
    idle_since: float | None = None
    waiting: bool = False          # a pod asked and it was not servable: PRIO_WANTED until it is
    freed: bool = False
    issued: int = 0                # credentials issued for this key so far
    quick_retry: bool = False      # a pod's request is held: a throttled call retries once soon
    unsendable: bool = False       # a tag value STS cannot take: denied, never fetched


# ---- the manager --------------------------------------------------------------------------------

class CredentialManager:
    """Prefetch, refresh and publish STS credentials for the pods of one node."""

    def __init__(self, *, table: CredentialTable, sts: AssumeRole, capacity: int,
                 notify: Callable[[], Any] = lambda: None,
                 node_name: str = "", base_role_arn: str | None = None,
                 session_policy: str = "node-role",
                 session_tags: bool | Iterable[str] = (),
                 tag_keys: str = "kiamfast", cluster_name: str = "",
                 duration: float = 3600.0, min_lifetime: float = 900.0,
                 refresh_fraction: float = 0.5, refresh_jitter: float = 0.1,
                 qps: float = 5.0, burst: int = 20, max_inflight: int = 8,
                 account_qps: float = 0.0, fleet_nodes: int = 0,
                 error_ttl: float = 0.0, error_ttl_floor: float = 5.0,
                 error_ttl_max: float = 60.0,
                 backoff_base: float = 1.0, backoff_max: float = 30.0,
                 throttle_base: float = 1.0, throttle_max: float = 30.0,
                 release_grace: float = 120.0,
                 slot_in_use: Callable[[int], bool] = lambda slot: False,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 registry: Any = None, rng: random.Random | None = None):
        if session_policy not in SESSION_POLICIES:
            raise ValueError(f"session_policy must be one of {SESSION_POLICIES}")
        if min_lifetime >= duration:
            raise ValueError("min_lifetime must be shorter than the session duration")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if tag_keys not in TAG_KEYS:
            raise ValueError(f"tag_keys must be one of {TAG_KEYS}")
        known = ((EKS_CLUSTER, *EKS_TAGS) if tag_keys == "eks"
                 else (*SESSION_TAGS, TAG_CLUSTER))
        if session_tags is True:       # all of them; the cluster's only when it has a name
            tags: tuple[str, ...] = tuple(
                t for t in known if cluster_name or t not in (EKS_CLUSTER, TAG_CLUSTER))
        elif session_tags is False or session_tags is None:
            tags = ()
        else:
            tags = tuple(session_tags)
            unknown = set(tags) - set(known)
            if unknown:
                raise ValueError(f"unknown session tags {sorted(unknown)}; one of {known}")
        self.table = table
        self.sts = sts
        self.capacity = capacity
        self.notify = notify
        self.node_name = node_name
        self.base_role_arn = base_role_arn or None
        self.session_policy = session_policy
        self.session_tags = tags
        self.eks_names = tag_keys == "eks"
        self.cluster_name = cluster_name
        self.duration = int(duration)
        self.min_lifetime = float(min_lifetime)
        self.refresh_fraction = refresh_fraction
        self.refresh_jitter = refresh_jitter
        self.max_inflight = max(1, max_inflight)
        self.error_ttl = max(float(error_ttl), error_ttl_floor)
        self.error_ttl_max = max(self.error_ttl, error_ttl_max)
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.throttle_base, self.throttle_max = throttle_base, throttle_max
        self.release_grace = release_grace
        self.slot_in_use = slot_in_use
        self.clock = clock
        self.sleep = sleep
        self.rng = rng or random.Random()
        # With a fleet budget but no node count yet (it comes from the API), the floor is
        # the one without a budget until set_fleet_nodes: the lower of the two.
        self.account_qps = account_qps
        self.bucket = TokenBucket(
            qps, burst, clock=clock, sleep=sleep,
            min_rate=node_share(account_qps, fleet_nodes, qps)
            if account_qps > 0 and fleet_nodes > 0 else None)

        self._entries: dict[CredentialKey, _Entry] = {}
        self._by_slot: dict[int, _Entry] = {}
        self._pods: dict[str, CredentialKey] = {}
        self._free = list(range(capacity))          # a heap: lowest slot first
        self._held: set[int] = set()                # see adopt()
        self._ready: list[tuple[int, int, _Entry]] = []
        self._timers: list[tuple[float, int, int, str, _Entry]] = []
        self._seq = itertools.count()
        self._inflight = 0
        self._queued = 0                    # entries with a live item in the ready queue
        self._waiting: set[_Entry] = set()  # entries with waiting=True
        self._token_wait = False
        self._throttle_streak = 0
        self._work = asyncio.Event()        # the ready queue got an item
        self._timer_wake = asyncio.Event()  # an earlier timer was added
        self._slot_free = asyncio.Event()   # an in-flight call finished
        self._stopped = asyncio.Event()
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        self._fetches: set[asyncio.Task] = set()
        self._counts = {"sts_success": 0, "sts_throttled": 0, "sts_transient": 0,
                        "sts_denied": 0, "refreshes": 0, "cache_hits": 0, "issued": 0,
                        "expired": 0, "evicted": 0}
        self._metrics = _Metrics(registry)
        self._metrics.rate.set(self.bucket.rate)

    # ---- configuration helpers --------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Any, *, table: Any, sts: AssumeRole,
                    notify: Callable[[], Any], fleet_nodes: int | None = None,
                    **overrides: Any) -> "CredentialManager":
        """Build from a ``kiamfast.config.Config`` and a ``kiamfast.table.Table``.
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
            error_ttl=config.iam_role_error_ttl)
        kwargs.update(overrides)
        return cls(**kwargs)

    def set_fleet_nodes(self, nodes: int) -> None:
        """The number of agents sharing ``account_qps`` is now ``nodes`` (the cluster's node
        count): the floor throttling may cut this node's rate down to follows its share."""
        if self.account_qps <= 0 or nodes < 1:
            return
        share = node_share(self.account_qps, nodes, self.bucket.max_rate)
        if share != self.bucket.min_rate:
            log.info("STS share: %.3g calls/s (%g over %d nodes)", share, self.account_qps,
                     nodes)
        self.bucket.min_rate = share
        self.bucket.rate = max(self.bucket.rate, share)
        self._metrics.rate.set(self.bucket.rate)

    def key_for(self, req: CredentialRequest, pod_uid: str = "") -> CredentialKey:
        """The credential key of a request under this manager's policies."""
        if self.eks_names:
            session = f"{req.pod_name}/{pod_uid}"      # one session per pod, as EKS
        elif self.session_policy == "node-role":
            session = self.node_name
        elif self.session_policy == "pod":
            session = f"{req.namespace}/{req.pod_name}"
        else:
            session = "kube2iam"
        values = {TAG_NAMESPACE: req.namespace, TAG_POD: req.pod_name,
                  TAG_SERVICE_ACCOUNT: req.service_account, TAG_NODE: self.node_name,
                  TAG_CLUSTER: self.cluster_name, EKS_CLUSTER: self.cluster_name,
                  "kubernetes-namespace": req.namespace,
                  "kubernetes-service-account": req.service_account,
                  "kubernetes-pod-name": req.pod_name, "kubernetes-pod-uid": pod_uid}
        tags = sorted((tag, values[tag]) for tag in self.session_tags)
        return CredentialKey(req.role_arn, req.external_id or None, session, tuple(tags))

    def session_name(self, key: CredentialKey,
                     users: Iterable[tuple[str, CredentialRequest]] = ()) -> str:
        """The RoleSessionName for a key (kube2iam's policy also looks at the users)."""
        role = render.role_name(key.role_arn)
        if self.eks_names:
            # EKS: eks-<cluster>-<pod>-<random>; the UID's first 8 hex digits instead, so
            # the name tells two pods of one name apart and stays the same across refreshes.
            pod, _, uid = key.session.partition("/")
            suffix = "-" + uid.replace("-", "")[:8] if uid else ""
            head = "-".join(p for p in ("eks", self.cluster_name, pod) if p)
            name = head[:64 - len(suffix)] + suffix     # sanitising keeps the length
        elif self.session_policy == "node-role":
            name = f"{self.node_name or 'kiamfast'}-{role}"
        elif self.session_policy == "pod":
            namespace, _, pod = key.session.partition("/")
            name = f"{namespace}.{pod}"
        else:
            users = list(users)
            ips = [req.pod_ip for _, req in users if req.pod_ip]
            basis = ips[0] if ips else (users[0][0] if users else key.role_arn)
            name = f"{fnv32a(basis):x}-{role}"
        return sanitize_session_name(name)

    # ---- the watcher's API ------------------------------------------------------------------

    def acquire(self, pod_uid: str, req: CredentialRequest) -> int:
        """Credential slot for a pod; allocates it and starts a prefetch on first use.

        Idempotent: the same pod and key give the same slot. A pod whose request maps to
        another key (its role annotation changed) leaves its old key first.
        Raises CredentialSlotsExhausted when every slot is in use by a live key.
        """
        if self._closed:
            raise ManagerClosed("credential manager is closed")
        key = self.key_for(req, pod_uid)
        old = self._pods.get(pod_uid)
        if old is not None:
            if old == key:
                entry = self._entries[key]
                entry.users[pod_uid] = req          # refresh what we know (e.g. its IP)
                return entry.slot
            self.release(pod_uid)
        entry = self._entries.get(key)
        if entry is not None:
            self._counts["cache_hits"] += 1
            self._metrics.cache_hit(key.role_arn)
            entry.users[pod_uid] = req
            self._pods[pod_uid] = key
            if entry.idle_since is not None:
                self._revive(entry)
            if entry.creds is not None and entry.state == _READY:
                self._audit("credentials shared", entry, pods=[(pod_uid, req)])
            return entry.slot
        slot = self._alloc_slot()
        entry = _Entry(key=key, slot=slot)
        entry.users[pod_uid] = req
        self._entries[key] = entry
        self._by_slot[slot] = entry
        self._pods[pod_uid] = key
        problem = tag_problem(key.tags)
        if problem:
            # Never sent without the tag or with another value: no credentials for this key.
            log.warning("pod %s/%s: no credentials for %s: %s", req.namespace, req.pod_name,
                        key.role_arn, problem)
            entry.unsendable = True
            self._on_failure(entry, StsDenied("InvalidSessionTag", problem,
                                              role_arn=key.role_arn))
            return slot
        self.table.write_cred(slot, [], serve_until=0.0, state=CRED_PENDING)
        self._notify()
        self._enqueue(entry, PRIO_NEW)
        return slot

    def release(self, pod_uid: str) -> None:
        """A pod is gone (or no longer uses its key). The last user gone stops refreshing;
        the slot is freed after ``release_grace`` unless a pod takes the key up again."""
        key = self._pods.pop(pod_uid, None)
        if key is None:
            return
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.users.pop(pod_uid, None)
        if not entry.users:
            self._set_waiting(entry, False)     # nobody waits for a key nobody uses
            entry.idle_since = self.clock()
            self._set_timer(entry, entry.idle_since + self.release_grace, "free")

    def wanted(self, slot: int) -> None:
        """A worker has a request for this slot and could not serve it: the key is waited
        for (first in the queue, through its retries), and tried now unless a call is in
        flight or the key is backing off."""
        entry = self._by_slot.get(slot)
        if entry is None or entry.freed or entry.idle_since is not None:
            return
        now = self.clock()
        if entry.state in (_READY, _DENIED) and (entry.state == _DENIED
                                                 or now < entry.serve_until):
            return  # servable from our point of view; the worker's read was stale
        self._set_waiting(entry, True)
        if entry.inflight or (now < entry.not_before
                              and not isinstance(entry.last_error, StsThrottled)):
            return
        entry.quick_retry = True
        self._enqueue(entry, PRIO_WANTED)

    def adopt(self, slots: Iterable[tuple[int, int, float, list[bytes]]]) -> int:
        """A restarted control process: take over what a previous one left in the table, as
        ``(slot, state, serve_until, parts)`` for every slot.  Servable credentials and
        error documents become entries of their key (idle until a pod acquires them, freed
        after ``release_grace`` otherwise); every other slot that holds anything is kept out
        of allocation until no address names it (:meth:`reclaim`).  Returns how many keys
        were adopted."""
        now = self.clock()
        adopted = 0
        for slot, state, serve_until, parts in slots:
            if not 0 <= slot < self.capacity or slot in self._by_slot:
                continue
            record = render.parse_key_part(parts)
            if state == CRED_EMPTY and record is None:
                continue
            self._free = [s for s in self._free if s != slot]
            key = None if record is None else CredentialKey(
                record["role_arn"], record["external_id"], record["session"],
                tuple(tuple(t) for t in record["tags"]))
            if (key is None or key in self._entries or state != CRED_READY
                    or serve_until <= now):
                self._held.add(slot)
                continue
            entry = _Entry(key=key, slot=slot, serve_until=serve_until,
                           fetched_at=record["fetched_at"], idle_since=now)
            if record["denied"]:
                entry.state = _DENIED
            else:
                entry.state = _READY
                entry.creds = Credentials(
                    access_key_id=record["access_key_id"], secret_access_key="",
                    session_token="",
                    expiration=_dt.datetime.fromtimestamp(record["expiration"], _dt.timezone.utc))
                entry.refresh_at = self._refresh_time(record["fetched_at"],
                                                      record["expiration"], serve_until)
            self._entries[key] = entry
            self._by_slot[slot] = entry
            self._set_timer(entry, now + self.release_grace, "free")
            adopted += 1
        heapq.heapify(self._free)
        if adopted or self._held:
            log.info("adopted %d credential keys from the table (%d slots held until free)",
                     adopted, len(self._held))
        return adopted

    def reclaim(self) -> None:
        """Free the held slots that no address names any more (call after commits)."""
        for slot in sorted(self._held):
            if not self.slot_in_use(slot):
                self._held.discard(slot)
                self.table.clear_cred(slot)
                heapq.heappush(self._free, slot)

    def role_of_slot(self, slot: int) -> tuple[str, str | None] | None:
        """(role ARN, external ID) of the key a slot holds (an adopted one included)."""
        entry = self._by_slot.get(slot)
        return None if entry is None else (entry.key.role_arn, entry.key.external_id)

    def slot_of(self, pod_uid: str) -> int | None:
        key = self._pods.get(pod_uid)
        return None if key is None else self._entries[key].slot

    # ---- life cycle -------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the scheduler until :meth:`close`."""
        if self._tasks:
            raise RuntimeError("already running")
        self._tasks = [asyncio.create_task(self._dispatch(), name="kiamfast-cred-dispatch"),
                       asyncio.create_task(self._timer_loop(), name="kiamfast-cred-timers")]
        try:
            waiter = asyncio.create_task(self._stopped.wait())
            done, _ = await asyncio.wait([waiter, *self._tasks],
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not waiter and not task.cancelled() and task.exception():
                    raise task.exception()  # a scheduler bug: let the supervisor see it
        finally:
            waiter.cancel()
            for task in [*self._tasks, *self._fetches]:
                task.cancel()
            await asyncio.gather(*self._tasks, *self._fetches, return_exceptions=True)
            self._tasks = []

    def close(self) -> None:
        """Stop scheduling; in-flight calls are abandoned. The STS client is the caller's."""
        self._closed = True
        self._stopped.set()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until nothing is in flight and nothing can start before time moves on
        (tests and benchmarks): queued work waiting for a rate-limit token or the end of a
        throttling pause counts as settled, as do timers.
        """
        async def _wait() -> None:
            while not self.settled:
                await asyncio.sleep(0.002)
        await asyncio.wait_for(_wait(), timeout)

    # ---- introspection ----------------------------------------------------------------------

    @property
    def settled(self) -> bool:
        """Nothing in flight and nothing that could start before time moves on (queued work
        waiting for a token or the end of a throttling pause counts as settled)."""
        return not (self._inflight or (self._live_ready() and not self._token_wait))

    def stats(self) -> dict[str, Any]:
        states = {s: 0 for s in (_PENDING, _READY, _ERROR, _DENIED)}
        idle = 0
        for e in self._entries.values():
            states[e.state] += 1
            idle += e.idle_since is not None
        return {
            **self._counts,
            "sts_calls": sum(self._counts[k] for k in ("sts_success", "sts_throttled",
                                                       "sts_transient", "sts_denied")),
            "inflight": self._inflight,
            "keys": len(self._entries),
            "pods": len(self._pods),
            "idle_keys": idle,
            "slots_free": len(self._free),
            "slots_held": len(self._held),
            "queued": self._live_ready(),
            "waiting_keys": len(self._waiting),
            "rate_limit": self.bucket.rate,
            "throttle_paused_for": max(0.0, self.bucket.paused_until - self.clock()),
            **{f"keys_{s}": n for s, n in states.items()},
        }

    @property
    def registry(self) -> Any:
        return self._metrics.registry

    def describe(self, slot: int) -> dict[str, Any] | None:
        """Debug view of one slot (no secrets)."""
        e = self._by_slot.get(slot)
        if e is None:
            return None
        return {"role_arn": e.key.role_arn, "external_id": bool(e.key.external_id),
                "session": e.key.session, "tags": dict(e.key.tags), "state": e.state,
                "access_key_id": e.creds.access_key_id if e.creds else None,
                "serve_until": e.serve_until, "refresh_at": e.refresh_at,
                "failures": e.failures, "users": sorted(e.users),
                "last_error": e.last_error.code if e.last_error else None}

    # ---- slots ------------------------------------------------------------------------------

    def _alloc_slot(self) -> int:
        if not self._free:
            idle = [e for e in self._entries.values()
                    if e.idle_since is not None and not self.slot_in_use(e.slot)]
            if not idle:
                raise CredentialSlotsExhausted(
                    f"all {self.capacity} credential slots are used by live keys")
            self._counts["evicted"] += 1
            self._free_entry(min(idle, key=lambda e: e.idle_since))
        return heapq.heappop(self._free)

    def _free_entry(self, entry: _Entry) -> None:
        if entry.freed:
            return
        if self.slot_in_use(entry.slot):
            # An address still points here (a restart before the model caught up, or a
            # release not yet committed): freeing now could hand it to another key.
            self._set_timer(entry, self.clock() + 1.0, "free")
            return
        entry.freed = True
        entry.timer += 1
        self._set_waiting(entry, False)
        if entry.queued is not None:
            entry.queued = None
            self._queued -= 1
        self._entries.pop(entry.key, None)
        self._by_slot.pop(entry.slot, None)
        if not any(k.role_arn == entry.key.role_arn for k in self._entries):
            self._metrics.forget_role(entry.key.role_arn)
        self.table.clear_cred(entry.slot)
        heapq.heappush(self._free, entry.slot)
        self._notify()

    def _revive(self, entry: _Entry) -> None:
        entry.idle_since = None
        entry.timer += 1  # cancels the "free" timer
        now = self.clock()
        if entry.inflight:
            return
        if entry.state == _READY and now < entry.serve_until:
            if entry.refresh_at <= now:
                self._enqueue(entry, PRIO_REFRESH)
            else:
                self._set_timer(entry, entry.refresh_at, "fetch", PRIO_REFRESH)
        elif now >= entry.not_before:
            self._enqueue(entry, PRIO_NEW)
        else:
            self._set_timer(entry, entry.not_before, "fetch", PRIO_NEW)

    # ---- queue and timers -------------------------------------------------------------------

    def _set_waiting(self, entry: _Entry, waiting: bool) -> None:
        entry.waiting = waiting
        entry.quick_retry = entry.quick_retry and waiting
        (self._waiting.add if waiting else self._waiting.discard)(entry)
        self._metrics.waiting.set(len(self._waiting))

    def _enqueue(self, entry: _Entry, prio: int) -> None:
        if entry.freed or entry.inflight or entry.unsendable:
            return
        if entry.waiting:
            prio = PRIO_WANTED
        if entry.queued is not None and entry.queued <= prio:
            return
        if entry.queued is None:
            self._queued += 1
        entry.queued = prio
        heapq.heappush(self._ready, (prio, next(self._seq), entry))
        self._work.set()

    def _set_timer(self, entry: _Entry, at: float, kind: str, prio: int = PRIO_NEW) -> None:
        entry.timer += 1
        heapq.heappush(self._timers, (at, next(self._seq), entry.timer, kind, entry))
        entry.timer_prio = prio
        if self._timers[0][4] is entry:
            self._timer_wake.set()

    def _wanted_first(self) -> bool:
        """The best item of the queue is a key a pod is waiting for."""
        while self._ready:
            prio, _, entry = self._ready[0]
            if entry.freed or entry.queued != prio:
                heapq.heappop(self._ready)
                continue
            return prio == PRIO_WANTED
        return False

    def _live_ready(self) -> int:
        return self._queued

    def _pop_ready(self) -> tuple[_Entry, int] | None:
        while self._ready:
            prio, _, entry = heapq.heappop(self._ready)
            if entry.freed or entry.queued != prio:
                continue  # superseded by a better priority, or freed
            entry.queued = None
            self._queued -= 1
            if entry.inflight or entry.idle_since is not None:
                continue
            return entry, prio
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
                if kind == "free":
                    if entry.idle_since is not None and not entry.users:
                        self._free_entry(entry)
                elif kind == "expire":
                    self._expire(entry)
                else:
                    self._enqueue(entry, entry.timer_prio)
            self._timer_wake.clear()
            delay = self._timers[0][0] - now if self._timers else None
            await self._wait_any(self._timer_wake, delay)

    async def _dispatch(self) -> None:
        while not self._closed:
            if not self._live_ready():
                self._work.clear()
                await self._work.wait()
                continue
            if self._inflight >= self.max_inflight:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            wait = self.bucket.try_take()
            if wait > 0 and self._wanted_first() and self.bucket.borrow():
                wait = 0.0      # a pod is held for it: go now, later tokens pay it back
            if wait > 0:  # rate limit or throttling pause: sleep, then look again
                self._token_wait = True
                self._work.clear()      # a key a pod waits for cuts the wait short
                try:
                    await self._wait_any(self._work, wait)
                finally:
                    self._token_wait = False
                continue
            item = self._pop_ready()
            if item is None:
                self.bucket.refund()
                continue
            entry, prio = item
            entry.inflight = True
            self._inflight += 1
            self._metrics.inflight.set(self._inflight)
            task = asyncio.create_task(self._fetch(entry, prio, self.bucket.tickets))
            self._fetches.add(task)
            task.add_done_callback(self._fetches.discard)

    # ---- one STS call -----------------------------------------------------------------------

    async def _fetch(self, entry: _Entry, prio: int, ticket: int) -> None:
        key = entry.key
        name = self.session_name(key, entry.users.items())
        started = time.monotonic()
        result: Credentials | StsError
        try:
            result = await self.sts.assume_role(
                key.role_arn, name, external_id=key.external_id, duration=self.duration,
                tags=list(key.tags) or None, transitive=self.eks_names)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # classified: StsError already, anything else -> transient
            result = classify(exc, role_arn=key.role_arn)
        finally:
            entry.inflight = False
            self._inflight -= 1
            self._metrics.inflight.set(self._inflight)
            self._slot_free.set()
        elapsed = time.monotonic() - started
        if isinstance(result, Credentials):
            self._metrics.sts_call(key.role_arn, "Success", "success", elapsed)
            self._counts["sts_success"] += 1
            self._throttle_streak = 0
            self.bucket.speed_up()
            self._metrics.rate.set(self.bucket.rate)
            if not entry.freed:
                try:
                    self._on_success(entry, result, name)
                except Exception as exc:  # e.g. ValueTooLarge: never leave the key stuck
                    log.exception("publishing credentials for %s failed", key.role_arn)
                    self._on_failure(entry, StsTransient(type(exc).__name__, str(exc),
                                                         role_arn=key.role_arn))
        else:
            kind = ("throttled" if isinstance(result, StsThrottled) else
                    "denied" if isinstance(result, StsDenied) else "transient")
            self._metrics.sts_call(key.role_arn, result.code or "UnknownError", kind, elapsed)
            self._counts[f"sts_{kind}"] += 1
            if isinstance(result, StsThrottled):
                self._throttle_streak += 1
                self.bucket.pause(backoff(self._throttle_streak, base=self.throttle_base,
                                          cap=self.throttle_max, rng=self.rng))
                self.bucket.slow_down(ticket)
                self._metrics.rate.set(self.bucket.rate)
            if not entry.freed:
                self._on_failure(entry, result)

    def _on_success(self, entry: _Entry, creds: Credentials, session_name: str) -> None:
        now = self.clock()
        expires = creds.expires_at
        serve_until = expires - self.min_lifetime
        if serve_until <= now + 1.0:
            # STS gave less than min_lifetime (clock skew?): never serve it.
            self._on_failure(entry, StsTransient(
                "ShortLifetime", f"credentials expire at {creds.expiration.isoformat()}",
                role_arn=entry.key.role_arn))
            return
        refreshed = entry.creds is not None
        parts = render.render_credentials(
            role_arn=entry.key.role_arn, base_role_arn=self.base_role_arn,
            access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key,
            session_token=creds.session_token, expiration=creds.expiration,
            last_updated=now)
        parts.append(render.key_part(
            role_arn=entry.key.role_arn, external_id=entry.key.external_id,
            session=entry.key.session, tags=entry.key.tags,
            access_key_id=creds.access_key_id, expiration=expires, fetched_at=now))
        self.table.write_cred(entry.slot, parts, serve_until=serve_until, state=CRED_READY)
        entry.creds = creds
        entry.state = _READY
        entry.serve_until = serve_until
        entry.fetched_at = now
        entry.failures = entry.denials = 0
        entry.last_error = None
        entry.not_before = 0.0
        self._set_waiting(entry, False)
        entry.issued += 1
        self._counts["issued"] += 1
        if refreshed:
            self._counts["refreshes"] += 1
            self._metrics.refreshes.inc()
        entry.refresh_at = self._refresh_time(now, expires, serve_until)
        self._notify()
        self._audit("credentials issued", entry, pods=list(entry.users.items()),
                    session_name=session_name)
        if entry.idle_since is None:
            self._set_timer(entry, entry.refresh_at, "fetch", PRIO_REFRESH)
        else:
            self._set_timer(entry, entry.idle_since + self.release_grace, "free")

    def _refresh_time(self, fetched_at: float, expires: float, serve_until: float) -> float:
        """Refresh at half-life, but leave at least a third of the serving window for retries
        when the session is short; jitter spreads keys fetched together."""
        ahead = min((expires - fetched_at) * self.refresh_fraction,
                    (serve_until - fetched_at) * 2 / 3)
        ahead -= self.rng.uniform(0.0, self.refresh_jitter * ahead)
        return fetched_at + ahead

    def _error_parts(self, entry: _Entry, err: StsError, now: float) -> list[bytes]:
        parts = render.render_error(role_arn=entry.key.role_arn, code=err.code,
                                    last_updated=now, base_role_arn=self.base_role_arn,
                                    reason=self._reason(entry, err))
        parts.append(render.key_part(
            role_arn=entry.key.role_arn, external_id=entry.key.external_id,
            session=entry.key.session, tags=entry.key.tags, access_key_id="",
            expiration=now + _ERROR_DOC_LIFETIME, fetched_at=now, denied=True))
        return parts

    @staticmethod
    def _reason(entry: _Entry, err: StsError) -> str:
        """What the pod and the log are told beyond the code: a refused tagged call most
        likely lacks sts:TagSession (STS says so in its message, pods never see it)."""
        if entry.unsendable:
            return err.message
        if entry.key.tags and err.code == "AccessDenied":
            return f"{TAGSESSION_HINT} ({err.message})" if err.message else TAGSESSION_HINT
        return ""

    def _on_failure(self, entry: _Entry, err: StsError) -> None:
        now = self.clock()
        entry.failures += 1
        entry.last_error = err
        denied = isinstance(err, StsDenied)
        if isinstance(err, StsThrottled):
            delay = max(0.0, self.bucket.paused_until - now)  # the node's pause, no more
        elif denied:
            entry.denials += 1
            delay = min(self.error_ttl_max, self.error_ttl * 2 ** (entry.denials - 1))
        else:
            delay = backoff(entry.failures, base=self.backoff_base, cap=self.backoff_max,
                            rng=self.rng)
        loud = entry.failures == 1 or entry.failures % 10 == 0
        level = logging.WARNING if loud else logging.DEBUG
        if not entry.unsendable:
            log.log(level, "AssumeRole failed: role=%s code=%s failures=%d retry_in=%.1fs: %s",
                    entry.key.role_arn, err.code, entry.failures, delay,
                    self._reason(entry, err) or err.message)
        servable = entry.state == _READY and now < entry.serve_until
        if servable:
            # Static stability: keep serving what we have; retry, at the latest at the end.
            retry_at = min(now + delay, entry.serve_until)
            entry.not_before = retry_at
            if entry.idle_since is None:
                if retry_at < entry.serve_until:
                    self._set_timer(entry, retry_at, "fetch", PRIO_REFRESH)
                else:  # the last chance is at serve_until; _expire retries after it
                    self._set_timer(entry, entry.serve_until, "expire")
            return
        entry.not_before = now + delay
        if denied:
            parts = self._error_parts(entry, err, now)
            self.table.write_cred(entry.slot, parts, serve_until=now + _ERROR_DOC_LIFETIME,
                                  state=CRED_READY)
            self._set_waiting(entry, False)    # the pod gets its answer: the error document
            entry.state = _DENIED
            entry.creds = None
            entry.serve_until = now + _ERROR_DOC_LIFETIME
        else:
            if entry.state == _READY:
                self._counts["expired"] += 1
            self.table.set_cred_state(entry.slot, CRED_ERROR)
            entry.state = _ERROR
        self._notify()
        if entry.idle_since is None:
            if isinstance(err, StsThrottled) and entry.quick_retry:
                # once per request a worker holds: the next token may be free within its wait
                entry.quick_retry = False
                self._set_timer(entry, now + self.rng.uniform(*QUICK_RETRY), "fetch",
                                PRIO_WANTED)
            else:
                self._set_timer(entry, entry.not_before, "fetch", PRIO_NEW)

    def _expire(self, entry: _Entry) -> None:
        """serve_until reached with no fresh credentials: stop serving (ERROR -> 503)."""
        now = self.clock()
        if entry.state != _READY or now < entry.serve_until:
            return
        self._counts["expired"] += 1
        if isinstance(entry.last_error, StsDenied):
            parts = self._error_parts(entry, entry.last_error, now)
            self.table.write_cred(entry.slot, parts, serve_until=now + _ERROR_DOC_LIFETIME,
                                  state=CRED_READY)
            entry.state = _DENIED
            entry.serve_until = now + _ERROR_DOC_LIFETIME
        else:
            self.table.set_cred_state(entry.slot, CRED_ERROR)
            entry.state = _ERROR
        entry.creds = None
        self._notify()
        if entry.idle_since is None and not entry.inflight:
            self._set_timer(entry, max(now, entry.not_before), "fetch", PRIO_NEW)

    # ---- side channels ----------------------------------------------------------------------

    def _notify(self) -> None:
        try:
            self.notify()
        except Exception:  # a broken notifier must not break the manager
            log.exception("notify callback failed")

    def _audit(self, event: str, entry: _Entry, *,
               pods: list[tuple[str, CredentialRequest]], session_name: str = "") -> None:
        creds = entry.creds
        if creds is None:
            return
        fields = {
            "event": event.replace(" ", "_"),
            "role_arn": entry.key.role_arn,
            "access_key_id": creds.access_key_id,
            "expiration": render.imds_time(creds.expiration),
            "session_name": session_name or self.session_name(entry.key, entry.users.items()),
            "external_id": bool(entry.key.external_id),
            "slot": entry.slot,
            "pods": sorted(f"{r.namespace}/{r.pod_name}" for _, r in pods),
            "pod_uids": sorted(uid for uid, _ in pods),
            "namespaces": sorted({r.namespace for _, r in pods}),
        }
        audit.info("%s role=%s access_key_id=%s expiration=%s pods=%s", event,
                   fields["role_arn"], fields["access_key_id"], fields["expiration"],
                   ",".join(fields["pods"]), extra={"audit": fields})


class _Metrics:
    """Prometheus metrics of the manager, on the given registry or a private one.

    kube2iam's per-role series (``role_arn`` label) grow with what pod authors write, so
    they are bounded: a role's series go when no key of that role is left, and at most
    ``ROLE_SERIES_MAX`` roles have series at a time (the rest are counted in
    ``kiamfast_metrics_series_dropped_total``).  That bounds the text the control process
    publishes for the workers (see ``METRICS_TEXT_MAX``)."""

    ROLE_SERIES_MAX = 64          # distinct roles with series at once
    CODES_PER_ROLE_MAX = 2        # result codes per role (Success and one error, typically)
    ROLE_LABEL_MAX = 256          # longer role ARNs (a pod author's choice) get no series

    def __init__(self, registry: Any):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.duration = Histogram(
            "kube2iam_iam_request_duration_seconds",
            "Time taken to complete IAM request in seconds.",
            ["code", "role_arn"], buckets=_STS_BUCKETS, registry=r)
        self.calls = Counter("kiamfast_sts_calls", "STS AssumeRole calls by result",
                             ["result"], registry=r)
        self.throttled = Counter("kiamfast_sts_throttled",
                                 "STS AssumeRole calls answered with throttling", registry=r)
        self.refreshes = Counter("kiamfast_credential_refreshes",
                                 "Credentials replaced ahead of expiry", registry=r)
        self.inflight = Gauge("kiamfast_sts_inflight", "STS calls in flight", registry=r)
        self.waiting = Gauge("kiamfast_sts_waiting_keys",
                             "Credential keys a pod asked for that are not servable yet",
                             registry=r)
        self.rate = Gauge("kiamfast_sts_rate_limit",
                          "This node's STS rate limit now (calls/s; throttling lowers it)",
                          registry=r)
        self.hits = Counter("kube2iam_iam_cache_hits", "Total number of IAM cache hits.",
                            ["role_arn"], registry=r)
        self.dropped = Counter("kiamfast_metrics_series_dropped",
                               "Observations not recorded per role because the number of "
                               "role series is at its bound", registry=r)
        for code in ("Success", "UnknownError"):     # as kube2iam, present from the start
            self.duration.labels(code=code, role_arn="")
        self._codes: dict[str, set[str]] = {}         # role -> codes with a series

    def _room(self, role_arn: str, code: str | None = None) -> bool:
        codes = self._codes.get(role_arn)
        if codes is None:
            if (len(self._codes) >= self.ROLE_SERIES_MAX
                    or len(role_arn) > self.ROLE_LABEL_MAX):
                self.dropped.inc()
                return False
            codes = self._codes[role_arn] = set()
        if code is not None and code not in codes:
            if len(codes) >= self.CODES_PER_ROLE_MAX:
                self.dropped.inc()
                return False
            codes.add(code)
        return True

    def sts_call(self, role_arn: str, code: str, result: str, elapsed: float) -> None:
        if self._room(role_arn, code):
            self.duration.labels(code=code, role_arn=role_arn).observe(elapsed)
        self.calls.labels(result=result).inc()
        if result == "throttled":
            self.throttled.inc()

    def cache_hit(self, role_arn: str) -> None:
        if self._room(role_arn):
            self.hits.labels(role_arn=role_arn).inc()

    def forget_role(self, role_arn: str) -> None:
        """No key of this role is left: its series go."""
        for code in self._codes.pop(role_arn, ()):
            self.duration.remove(code, role_arn)
        try:
            self.hits.remove(role_arn)
        except KeyError:
            pass


# Upper bound of the control process's metrics text, from the series bounds above: a line
# of a per-role series is at most 128 bytes plus the role label, a histogram series has a
# line per bucket plus +Inf, sum and count; 64 KiB for everything else (fixed gauges, the
# watch's and the runtime's counters).  The aux blobs are sized from it (kiamfast.supervisor).
_LINE_MAX = 128 + _Metrics.ROLE_LABEL_MAX
METRICS_TEXT_MAX = (_Metrics.ROLE_SERIES_MAX
                    * (_Metrics.CODES_PER_ROLE_MAX * (len(_STS_BUCKETS) + 3) + 1) * _LINE_MAX
                    + 64 * 1024)
