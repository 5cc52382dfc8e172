"""Which pod owns which address, decided from everything the control process has heard.

Every agent before kiamfast lost credentials (or handed out another pod's) in the moments
when its picture of the node was incomplete: a pod asking before its IP reached the watch,
an address reused while the old pod's delete was still on its way, a watch that dropped
and came back.  This module is the one place that decides, from the events the watch, the
relists and the kubelet deliver, which pod owns each address, and it writes exactly that
into the shared table.  It is synchronous and does no I/O besides table writes and calls
into the credential sink; `kiamfast.control.pods` feeds it.

Rules:

* A pod owns its addresses (`status.podIPs`, falling back to `status.podIP`) while its phase
  is Pending, Running or Unknown and it is not hostNetwork.  A terminal phase (Succeeded,
  Failed) or the delete releases them at once.  A terminating pod (deletionTimestamp) keeps
  them until one of those.
* Two pods can claim one address at once: the API server still shows a dead pod Running
  after its address went to a new pod (kube2iam #107, kiam "multiple running pods").  Each
  (pod, address) claim gets a key when it is first seen, and the claim with the highest key
  owns the address:
  1. the resourceVersion that first showed it: the watch event's, or the list's for a claim
     first seen in a list.  resourceVersions order the API writes, and an address is
     written to a pod's status only after its previous owner gave it up, so a claim seen
     later is newer.  (Claims new in a relist happened during the gap, so they are newer
     than anything seen before it.)
  2. at the same resourceVersion, the kubelet's observations over the API's, later ones over
     earlier ones;
  3. creationTimestamp (newer wins), then non-terminating over terminating, then UID: only
     for claims first seen in the same list (the initial list after a restart), where
     nothing better is known.
  A claim keeps its first key: a late event of an old pod never makes it newer.
* High-water mark: an address remembers the highest key that ever owned it for as long as any
  pod still claims it.  A claim below the mark never owns the address, so when the new owner
  goes away the address becomes free, never the stale old pod's again.
* The kubelet's view (`apply_kubelet`) adds addresses the API has not published for a pod,
  or a pod the watch has not delivered yet.  It never releases an address the API gave
  (it only takes back what it said itself), never re-ranks what the API published, never
  resurrects a deleted or terminal pod, and is ignored for a pod whose object it holds in
  an older version than the watch delivered.  A publication of the pod's addresses newer
  than the kubelet's copy supersedes what the kubelet said.  Pods known only from the
  kubelet expire unless the watch confirms them.
* Dating the kubelet's view: `/pods` carries no list resourceVersion.  A kubelet copy of a
  pod newer than the watch's (or of a pod the watch has not delivered) may just mirror the
  API at that version, so its claims are as new as that object's resourceVersion.  A copy
  of the same version as the one we hold that names other addresses is the kubelet's own
  knowledge: "now", the highest resourceVersion seen in the kubelet's pods or
  from the watch; so is the claim of the newest pod among several the kubelet shows with
  one address, or one the kubelet just took back from another pod.  The kubelet's copies
  of pods the watch has not delivered yet are remembered, so an older API version of such
  a pod cannot claim what the kubelet no longer shows.
  Known limits (tests/control/test_ownership_property.py holds the model exact when the
  kubelet races the API's publication of addresses, the race it is asked for): when the
  watch itself lags, the kubelet's and the watch's versions of the same pods interleave
  and stale claims are ranked heuristically; e.g. a watch lagging by the whole life of a
  since-deleted pod can rank that pod's stale publication above the kubelet's newer claim
  until the pod's end arrives.
* Identity: `RolePolicy.decide` per pod; denied pods are written `POD_DENIED` (workers answer
  404 at once), pods without a role `POD_NO_ROLE`, pods with a role `POD_ROLE` with the slot
  the credential sink hands out (`sink.acquire`, which also starts the prefetch, even before
  the pod has an address).  A pod whose namespace the agent has not seen yet (and whose
  decision depends on it) is undecided: its addresses are not written (nor left to anyone
  else) and it counts as pending, for at most `namespace_grace` seconds, then denied.
* `pending_pods` (published in the table) counts live pods that have no address yet or are
  undecided: while it is above zero, a worker with an unknown caller waits for the table to
  change instead of answering 404.  It is lowered only after the addresses are written.

Writes are batched: the mutators only record what changed; `commit()` acquires credentials,
writes claims before releases (a moved address is one write, a relist never leaves a live pod
missing), releases credentials of pods that no longer need them, publishes `pending_pods` and
`synced`, and calls `notify()` once if anything changed.

What it must never do: map an address to a pod that does not own it, give an address back to
a pod that lost it, or let the kubelet's (possibly stale) view undo what the watch said.
"""
from __future__ import annotations

import ipaddress
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

from kiamfast.control.roles import IdentityKind, NamespaceRules, PodIdentity, RolePolicy

log = logging.getLogger("kiamfast.ownership")

# kiamfast.table pod states (checked against the table module by the tests).
POD_ROLE, POD_NO_ROLE, POD_DENIED = 1, 2, 3

LIVE_PHASES = frozenset({"", "Pending", "Running", "Unknown"})
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})

# Claim key: (seen resourceVersion, kubelet observation sequence (0 = from the API),
# creationTimestamp, not terminating, uid)
ClaimKey = tuple[int, int, str, int, str]


class CredentialSink(Protocol):
    """The credential manager as the ownership model uses it."""

    def acquire(self, pod_uid: str, req: Any) -> int: ...

    def release(self, pod_uid: str) -> None: ...


class TableWriter(Protocol):
    """The writer half of `kiamfast.table.Table` this model uses."""

    def claim_ip(self, ip: str, pod_uid: str, pod_state: int, cred_slot: int = -1) -> None: ...

    def release_ip(self, ip: str, pod_uid: str) -> bool: ...

    def set_status(self, *, synced: bool | None = None, ready: bool | None = None,
                   pending_pods: int | None = None,
                   default_cred_slot: int | None = None) -> None: ...


def _default_request_factory(**fields: Any) -> Any:
    from kiamfast.control.credentials import CredentialRequest
    return CredentialRequest(**fields)


def canonical_ip(ip: str) -> str | None:
    """The address in one spelling (IPv6 compressed, IPv4-mapped IPv6 as IPv4), or None."""
    try:
        a = ipaddress.ip_address(ip.strip())
    except ValueError:
        return None
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return str(a.ipv4_mapped)
    return a.compressed


def resource_version(obj: Mapping[str, Any]) -> int:
    """metadata.resourceVersion as an integer (etcd revisions are; 0 when absent or opaque)."""
    rv = (obj.get("metadata") or {}).get("resourceVersion") or "0"
    try:
        return int(rv)
    except (TypeError, ValueError):
        return 0


def pod_ips(obj: Mapping[str, Any]) -> tuple[str, ...]:
    """`status.podIPs` (all families), falling back to `status.podIP`; canonical, unique."""
    status = obj.get("status") or {}
    raw = [e.get("ip", "") for e in (status.get("podIPs") or []) if isinstance(e, dict)]
    if not raw and status.get("podIP"):
        raw = [status["podIP"]]
    out: list[str] = []
    for r in raw:
        c = canonical_ip(r) if r else None
        if c is None:
            if r:
                log.warning("ignoring malformed pod IP %r", r)
            continue
        if c not in out:
            out.append(c)
    return tuple(out)


@dataclass(slots=True)
class _Pod:
    uid: str
    namespace: str
    name: str
    rv: int = 0
    created: str = ""
    phase: str = ""
    host_network: bool = False
    terminating: bool = False
    annotations: Mapping[str, str] = field(default_factory=dict)
    service_account: str = ""
    api_ips: tuple[str, ...] = ()
    api_ips_rv: int = 0                  # version at which api_ips last changed
    kubelet_ips: tuple[str, ...] = ()    # addresses only the kubelet has reported
    kubelet_rv: int = 0                  # resourceVersion of the kubelet's latest copy
    kubelet_shown: frozenset[str] = frozenset()   # every address that copy showed
    api_known: bool = False          # seen in a watch event or list (not only the kubelet)
    kubelet_seen: float = 0.0        # monotonic time of the last kubelet observation
    identity: PodIdentity | None = None   # None: undecided (not yet evaluated / ns unknown)
    undecided_since: float | None = None
    cred_slot: int = -1
    cred_key: tuple[str, str, str | None] | None = None   # (role, external id, ip) acquired
    claims: dict[str, ClaimKey] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES and not self.host_network

    @property
    def ips(self) -> tuple[str, ...]:
        api = self.api_ips
        if self.kubelet_rv and self.api_ips_rv <= self.kubelet_rv:
            # The kubelet has seen the version that published these addresses (or a newer
            # one) and shows others: they are already superseded.
            api = tuple(ip for ip in api if ip in self.kubelet_shown)
        return api + self.kubelet_ips


class Ownership:
    """The node's pods, their identities and their addresses; the table's only writer of
    IP slots.  Feed it events, then `commit()`."""

    def __init__(
        self,
        *,
        policy: RolePolicy,
        table: TableWriter,
        sink: CredentialSink,
        notify: Callable[[], None] = lambda: None,
        request_factory: Callable[..., Any] = _default_request_factory,
        provisional_ttl: float = 30.0,
        namespace_grace: float = 10.0,
        tombstones: int = 16384,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.table = table
        self.sink = sink
        self.notify = notify
        self.request_factory = request_factory
        self.provisional_ttl = provisional_ttl
        self.namespace_grace = namespace_grace
        self.clock = clock
        self.pods: dict[str, _Pod] = {}
        self.namespaces: dict[str, NamespaceRules] = {}
        self._by_ns: dict[str, set[str]] = {}
        self._claimants: dict[str, set[str]] = {}
        self._hw: dict[str, ClaimKey] = {}
        self._written: dict[str, tuple[str, int, int]] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._hints: OrderedDict[str, tuple[int, frozenset[str]]] = OrderedDict()
        self._tombstone_cap = tombstones
        self._dirty_ips: set[str] = set()
        self._dirty_pods: set[str] = set()
        self._gone: set[str] = set()           # pods whose credentials to release after writes
        self._pending: set[str] = set()
        self._retry: set[str] = set()          # pods whose credential acquire failed
        self._published: tuple[int, bool] | None = None
        self._synced = False
        self.watermark = 0                     # highest resourceVersion seen from the API
        self._kseq = 0                         # kubelet observations so far
        self.counters: dict[str, int] = {
            "claims": 0, "releases": 0, "commits": 0, "stale_events": 0,
            "kubelet_claims": 0, "displaced": 0, "table_full": 0, "acquire_errors": 0,
        }

    # ---- queries ------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def pending_pods(self) -> int:
        return len(self._pending)

    def owner(self, ip: str) -> str | None:
        """The pod UID the table maps `ip` to (after the last commit), or None."""
        c = canonical_ip(ip)
        w = self._written.get(c) if c else None
        return w[0] if w else None

    def mapping(self) -> dict[str, tuple[str, int, int]]:
        """ip -> (uid, pod state, credential slot) as written to the table."""
        return dict(self._written)

    def debug_store(self) -> dict[str, Any]:
        """kube2iam's /debug/store view: namespaceByIP, rolesByIP, rolesByNamespace."""
        ns_by_ip: dict[str, str] = {}
        roles_by_ip: dict[str, str] = {}
        for ip, (uid, _, _) in sorted(self._written.items()):
            pod = self.pods.get(uid)
            if pod is None:
                continue
            ns_by_ip[ip] = pod.namespace
            roles_by_ip[ip] = pod.annotations.get(self.policy.role_key, "")
        return {"namespaceByIP": ns_by_ip, "rolesByIP": roles_by_ip,
                "rolesByNamespace": {n: list(r.allowed_globs)
                                     + [p.pattern for p in r.allowed_regexps]
                                     for n, r in sorted(self.namespaces.items())}}

    # ---- pods from the API ----------------------------------------------------------------------

    def apply_pod(self, obj: Mapping[str, Any], *, seen: int | None = None) -> None:
        """An ADDED/MODIFIED pod (watch event, or list item with `seen` = the list's RV)."""
        meta = obj.get("metadata") or {}
        uid = meta.get("uid") or ""
        if not uid or uid in self._tombstones:
            return
        rv = resource_version(obj)
        pod = self.pods.get(uid)
        if pod is not None and pod.api_known and rv and rv < pod.rv:
            self.counters["stale_events"] += 1
            return
        self.watermark = max(self.watermark, rv)
        if pod is None:
            pod = _Pod(uid=uid, namespace=meta.get("namespace") or "", name=meta.get("name") or "")
            hint = self._hints.pop(uid, None)
            if hint is not None:
                pod.kubelet_rv, pod.kubelet_shown = hint
            self.pods[uid] = pod
            self._by_ns.setdefault(pod.namespace, set()).add(uid)
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        annotations = meta.get("annotations") or {}
        was_live = pod.live
        old_ann = (pod.annotations.get(self.policy.role_key),
                   pod.annotations.get(self.policy.external_id_key))
        pod.rv = rv
        pod.created = meta.get("creationTimestamp") or pod.created
        pod.phase = status.get("phase") or ""
        pod.host_network = bool(spec.get("hostNetwork"))
        pod.terminating = bool(meta.get("deletionTimestamp"))
        pod.annotations = annotations
        pod.service_account = spec.get("serviceAccountName") or spec.get("serviceAccount") or ""
        api_ips = pod_ips(obj)
        if api_ips != pod.api_ips:
            pod.api_ips = api_ips
            pod.api_ips_rv = rv
            if rv > pod.kubelet_rv:
                # A publication newer than the kubelet's copy supersedes what it told us.
                pod.kubelet_ips = ()
            else:
                pod.kubelet_ips = tuple(ip for ip in pod.kubelet_ips if ip not in api_ips)
        pod.api_known = True
        new_ann = (annotations.get(self.policy.role_key),
                   annotations.get(self.policy.external_id_key))
        if pod.identity is None or was_live != pod.live or old_ann != new_ann:
            self._dirty_pods.add(uid)
        self._set_claims(pod, seen=rv if seen is None else seen)

    def note_resource_version(self, obj: Mapping[str, Any]) -> None:
        """A watch bookmark: the API server has progressed this far (dates kubelet views)."""
        self.watermark = max(self.watermark, resource_version(obj))

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        """A DELETED pod: it loses its addresses (only where it still owns them)."""
        uid = (obj.get("metadata") or {}).get("uid") or ""
        self.watermark = max(self.watermark, resource_version(obj))
        if uid:
            self._remove(uid)

    def replace_pods(self, items: Iterable[Mapping[str, Any]], *, list_rv: int = 0,
                     started: float | None = None) -> None:
        """A full list (initial or relist) at `list_rv`: adds and updates first, then the pods
        that are no longer listed are removed.  Pods known only from the kubelet and seen
        after `started` (when the list was requested) are kept: the list may predate them."""
        items = list(items)
        if not list_rv:
            list_rv = max([self.watermark] + [resource_version(o) for o in items])
        listed: set[str] = set()
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid")
            if uid:
                listed.add(uid)
                self.apply_pod(obj, seen=list_rv)
        self.watermark = max(self.watermark, list_rv)
        for uid, pod in list(self.pods.items()):
            if uid in listed:
                if pod.kubelet_ips and pod.live:
                    self._rerank_kubelet_claims(pod, list_rv)
                continue
            if not pod.api_known and started is not None and pod.kubelet_seen >= started:
                continue
            self._remove(uid)

    # ---- namespaces ---------------------------------------------------------------------------

    def apply_namespace(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name") or ""
        if not name:
            return
        rules = self.policy.namespace_rules(name, meta.get("annotations") or {})
        if self.namespaces.get(name) != rules:
            self.namespaces[name] = rules
            if self.policy.uses_namespaces:
                self._dirty_pods.update(self._by_ns.get(name, ()))

    def delete_namespace(self, obj: Mapping[str, Any]) -> None:
        """A deleted namespace keeps its rules: its pods are deleted before it, but the pod
        watch may deliver those deletes later; their identity must not flip meanwhile."""

    def replace_namespaces(self, items: Iterable[Mapping[str, Any]]) -> None:
        names = set()
        for obj in items:
            names.add((obj.get("metadata") or {}).get("name") or "")
            self.apply_namespace(obj)
        for name in list(self.namespaces):
            if name not in names and not self._by_ns.get(name):
                del self.namespaces[name]

    # ---- the kubelet --------------------------------------------------------------------------

    def apply_kubelet(self, items: Iterable[Mapping[str, Any]]) -> int:
        """The kubelet's /pods: addresses the API server has not published yet.  Returns how
        many pods got addresses from it."""
        items = list(items)
        now = self.clock()
        self._kseq += 1
        kseq = self._kseq
        newest = max([self.watermark] + [resource_version(o) for o in items])
        shown: dict[str, set[str]] = {}
        holders: dict[str, tuple[str, str]] = {}
        dup: set[str] = set()
        for obj in items:
            meta = obj.get("metadata") or {}
            uid = meta.get("uid") or ""
            live = ((obj.get("status") or {}).get("phase") or "") in LIVE_PHASES and \
                not (obj.get("spec") or {}).get("hostNetwork")
            ips = set(pod_ips(obj)) if live else set()
            shown[uid] = ips
            for ip in ips:
                cand = (meta.get("creationTimestamp") or "", uid)
                if ip in holders:
                    dup.add(ip)
                    cand = max(cand, holders[ip])
                holders[ip] = cand
        # The kubelet takes back what it said before and no longer says (only its own
        # claims: what the API published is never touched).
        withdrawn: set[str] = set()
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid") or ""
            pod = self.pods.get(uid)
            obj_rv = resource_version(obj)
            if pod is None:
                # Not delivered by the watch yet: remember which version the kubelet saw,
                # so an older version arriving later cannot claim what it no longer shows.
                if uid and uid not in self._tombstones:
                    self._hints[uid] = (obj_rv, frozenset(shown.get(uid, ())))
                    self._hints.move_to_end(uid)
                    while len(self._hints) > self._tombstone_cap:
                        self._hints.popitem(last=False)
                continue
            if not pod.live or (pod.api_known and obj_rv < pod.rv) or obj_rv < pod.kubelet_rv:
                continue
            before = pod.ips
            pod.kubelet_rv = obj_rv
            pod.kubelet_shown = frozenset(shown.get(uid, ()))
            if pod.ips != before:
                self._set_claims(pod, seen=pod.rv)
        for uid, pod in self.pods.items():
            if not pod.kubelet_ips:
                continue
            here = shown.get(uid, set())
            gone = [ip for ip in pod.kubelet_ips if ip not in here]
            if gone and not (pod.api_known and uid in shown and
                             self._kubelet_copy_older(items, uid, pod)):
                withdrawn.update(gone)
                pod.kubelet_ips = tuple(ip for ip in pod.kubelet_ips if ip in here)
                self._set_claims(pod, seen=pod.rv)
        n = 0
        for obj in items:
            meta = obj.get("metadata") or {}
            uid = meta.get("uid") or ""
            ips = tuple(sorted(shown.get(uid, ())))
            if not uid or not ips or uid in self._tombstones:
                continue
            pod = self.pods.get(uid)
            obj_rv = resource_version(obj)
            if pod is not None and (not pod.live or (pod.api_known and obj_rv < pod.rv)):
                continue   # ended, or the kubelet's copy is older than what the watch said
            # Dating.  A copy newer than ours (or of a pod the watch has not delivered) may
            # just mirror the API at that version: as new as that version.  The kubelet's own
            # knowledge is "now": the same version as ours with other addresses, the newest
            # of several pods it shows with one address, or an address it just took back
            # from another pod.
            own = any((ip in dup and holders[ip][1] == uid) or ip in withdrawn for ip in ips)
            if pod is not None and obj_rv == pod.rv:
                fresh_ips = {ip for ip in ips if ip not in pod.api_ips}
                own = own or pod.api_known or fresh_ips != set(pod.kubelet_ips)
            if pod is None:
                spec = obj.get("spec") or {}
                pod = _Pod(uid=uid, namespace=meta.get("namespace") or "",
                           name=meta.get("name") or "", rv=obj_rv,
                           created=meta.get("creationTimestamp") or "",
                           phase=(obj.get("status") or {}).get("phase") or "",
                           terminating=bool(meta.get("deletionTimestamp")),
                           annotations=meta.get("annotations") or {},
                           service_account=spec.get("serviceAccountName") or "")
                self.pods[uid] = pod
                self._by_ns.setdefault(pod.namespace, set()).add(uid)
                self._dirty_pods.add(uid)
            elif not pod.api_known:
                pod.rv = max(pod.rv, obj_rv)
            pod.kubelet_seen = now
            extra = tuple(ip for ip in ips if ip not in pod.api_ips)
            if not extra:
                continue
            pod.kubelet_ips = extra
            if obj_rv >= pod.kubelet_rv:
                pod.kubelet_rv = obj_rv
                pod.kubelet_shown = frozenset(ips)
            seen = newest if own else max(obj_rv, self.watermark)
            self._set_claims(pod, seen=seen, kubelet=(seen, kseq), refresh=own)
            n += 1
        self.counters["kubelet_claims"] += n
        return n

    @staticmethod
    def _kubelet_copy_older(items: list[Mapping[str, Any]], uid: str, pod: "_Pod") -> bool:
        for obj in items:
            if (obj.get("metadata") or {}).get("uid") == uid:
                return resource_version(obj) < pod.rv
        return False

    def knows_ip(self, ip: str) -> bool:
        c = canonical_ip(ip)
        return bool(c and self._claimants.get(c))

    # ---- time ---------------------------------------------------------------------------------

    def expire(self) -> None:
        """Drop kubelet-only pods the watch never confirmed; deny pods whose namespace stayed
        unknown past the grace period.  Call every second or so."""
        now = self.clock()
        self._dirty_pods.update(u for u in self._retry if u in self.pods)
        self._retry.clear()
        for uid, pod in list(self.pods.items()):
            if not pod.api_known and now - pod.kubelet_seen > self.provisional_ttl:
                log.info("pod %s/%s known only from the kubelet for %.0fs; forgetting it",
                         pod.namespace, pod.name, now - pod.kubelet_seen)
                self._remove(uid, tombstone=False)
            elif (pod.undecided_since is not None
                  and now - pod.undecided_since > self.namespace_grace):
                self._dirty_pods.add(uid)

    def set_synced(self, synced: bool) -> None:
        self._synced = synced

    # ---- commit -------------------------------------------------------------------------------

    def commit(self) -> bool:
        """Write everything recorded since the last commit; returns whether the table changed."""
        changed = False
        for uid in sorted(self._dirty_pods):
            pod = self.pods.get(uid)
            if pod is not None:
                self._decide(pod)
        self._dirty_pods.clear()
        claims: list[tuple[str, tuple[str, int, int]]] = []
        releases: list[tuple[str, str]] = []
        for ip in sorted(self._dirty_ips):
            want = self._desired(ip)
            have = self._written.get(ip)
            if want == have:
                continue
            if want is not None:
                claims.append((ip, want))
            elif have is not None:
                releases.append((ip, have[0]))
        self._dirty_ips.clear()
        for ip, (uid, state, slot) in claims:
            try:
                self.table.claim_ip(ip, uid, state, slot)
            except Exception as e:   # TableFull: the pod stays unknown to workers (MISS)
                self.counters["table_full"] += 1
                log.error("cannot write %s -> %s: %s", ip, uid, e)
                have = self._written.pop(ip, None)
                if have is not None:
                    self.table.release_ip(ip, have[0])
                continue
            self._written[ip] = (uid, state, slot)
            self.counters["claims"] += 1
            changed = True
        for ip, uid in releases:
            self.table.release_ip(ip, uid)
            del self._written[ip]
            self.counters["releases"] += 1
            changed = True
        for uid in self._gone:
            self.sink.release(uid)
        self._gone.clear()
        status = (len(self._pending), self._synced)
        if status != self._published:
            self.table.set_status(pending_pods=status[0], synced=status[1])
            self._published = status
            changed = True
        self.counters["commits"] += 1
        if changed:
            self.notify()
        return changed

    # ---- internals ----------------------------------------------------------------------------

    def _remove(self, uid: str, *, tombstone: bool = True) -> None:
        pod = self.pods.pop(uid, None)
        if tombstone:
            self._tombstones[uid] = None
            self._tombstones.move_to_end(uid)
            while len(self._tombstones) > self._tombstone_cap:
                self._tombstones.popitem(last=False)
        if pod is None:
            return
        members = self._by_ns.get(pod.namespace)
        if members is not None:
            members.discard(uid)
            if not members:
                del self._by_ns[pod.namespace]
        for ip in list(pod.claims):
            self._drop_claim(pod, ip)
        self._pending.discard(uid)
        if pod.cred_key is not None:
            self._gone.add(uid)
        self._dirty_pods.discard(uid)

    def _set_claims(self, pod: _Pod, *, seen: int, kubelet: tuple[int, int] | None = None,
                    refresh: bool = False) -> None:
        """Make the pod's claims match its addresses.  New claims on published addresses get
        keys at `seen`; on kubelet-only addresses at `kubelet` (resourceVersion, kubelet
        sequence); with `refresh`, existing kubelet claims are raised to it (the kubelet says
        the pod has the address now)."""
        wanted = set(pod.ips) if pod.live else set()
        for ip in list(pod.claims):
            if ip not in wanted:
                self._drop_claim(pod, ip)
        rank = 0 if pod.terminating else 1
        for ip in wanted:
            key = pod.claims.get(ip)
            from_kubelet = ip not in pod.api_ips
            if key is None:
                if from_kubelet and kubelet is not None:
                    at, k = kubelet
                else:
                    at, k = seen, 0
                pod.claims[ip] = (at, k, pod.created, rank, pod.uid)
                self._claimants.setdefault(ip, set()).add(pod.uid)
                self._dirty_ips.add(ip)
            elif from_kubelet and kubelet is not None and refresh:
                fresh: ClaimKey = (kubelet[0], kubelet[1], pod.created, rank, pod.uid)
                if fresh > key:
                    pod.claims[ip] = fresh
                    self._dirty_ips.add(ip)
        if pod.cred_key is not None and pod.cred_key[2] is None and pod.ips:
            self._dirty_pods.add(pod.uid)   # tell the credential manager the pod's address
        self._refresh_pending(pod)

    def _rerank_kubelet_claims(self, pod: _Pod, list_rv: int) -> None:
        """After a relist: a claim only the kubelet reported (still unpublished) stays newer
        than the claims this list showed for the first time, unless one of those objects was
        written after the kubelet's view (then it may be the newer claim, and it wins)."""
        for ip in pod.kubelet_ips:
            key = pod.claims.get(ip)
            if key is None or key[1] == 0:
                continue
            ahead: list[ClaimKey] = []
            passable = True
            for u in self._claimants.get(ip, ()):
                if u == pod.uid:
                    continue
                r = self.pods[u]
                rk = r.claims[ip]
                if rk < key:
                    continue
                ahead.append(rk)
                # Only claims this list showed first, on objects no newer than the kubelet's
                # view, are older than what the kubelet said.
                if not (rk[0] == list_rv and rk[1] == 0 and r.rv <= key[0]):
                    passable = False
                    break
            hw = self._hw.get(ip)
            if not passable or not ahead or (hw is not None and hw > max(ahead)):
                continue   # nothing to pass, or the address's history says the claim is old
            fresh: ClaimKey = (list_rv, key[1], pod.created, key[3], pod.uid)
            if fresh > key:
                pod.claims[ip] = fresh
                self._dirty_ips.add(ip)

    def _drop_claim(self, pod: _Pod, ip: str) -> None:
        del pod.claims[ip]
        members = self._claimants.get(ip)
        if members is not None:
            members.discard(pod.uid)
            if not members:
                del self._claimants[ip]
                self._hw.pop(ip, None)
        self._dirty_ips.add(ip)

    def _refresh_pending(self, pod: _Pod) -> None:
        if pod.live and (not pod.ips or pod.identity is None):
            self._pending.add(pod.uid)
        else:
            self._pending.discard(pod.uid)

    def _owner(self, ip: str) -> str | None:
        members = self._claimants.get(ip)
        if not members:
            return None
        best_key: ClaimKey | None = None
        best = None
        for uid in members:
            k = self.pods[uid].claims[ip]
            if best_key is None or k > best_key:
                best_key, best = k, uid
        assert best_key is not None
        hw = self._hw.get(ip)
        if hw is not None and best_key < hw:
            return None   # every remaining claim is older than one that already won
        if hw is not None and best_key > hw:
            self.counters["displaced"] += 1
        self._hw[ip] = best_key
        return best

    def _desired(self, ip: str) -> tuple[str, int, int] | None:
        uid = self._owner(ip)
        if uid is None:
            return None
        pod = self.pods[uid]
        ident = pod.identity
        if ident is None:
            return None   # undecided: no answer yet; workers wait (pending_pods)
        if ident.kind == IdentityKind.ROLE:
            return (uid, POD_ROLE, pod.cred_slot)
        if ident.kind == IdentityKind.NO_ROLE:
            return (uid, POD_NO_ROLE, -1)
        return (uid, POD_DENIED, -1)

    def _decide(self, pod: _Pod) -> None:
        if not pod.live:
            # Terminal (or hostNetwork): no addresses, no credentials.
            if pod.cred_key is not None:
                self._gone.add(pod.uid)
                pod.cred_key = None
                pod.cred_slot = -1
            pod.identity = PodIdentity.denied("not running")
            pod.undecided_since = None
            self._refresh_pending(pod)
            return
        self._gone.discard(pod.uid)
        rules = self.namespaces.get(pod.namespace)
        ident = self.policy.decide(pod.annotations, rules, namespace=pod.namespace, pod=pod.name)
        if rules is None and ident.kind == IdentityKind.DENIED and ident.namespace_unknown:
            now = self.clock()
            if pod.undecided_since is None:
                pod.undecided_since = now
            if now - pod.undecided_since <= self.namespace_grace:
                ident = None   # our namespace watch is behind the pod watch: wait
            else:
                log.warning("pod %s/%s: namespace %s still unknown after %.0fs; denying",
                            pod.namespace, pod.name, pod.namespace, self.namespace_grace)
        if ident is not None:
            pod.undecided_since = None
        if ident is not None and ident.kind == IdentityKind.ROLE:
            ip = pod.ips[0] if pod.ips else None
            want = (ident.role_arn, ident.external_id, ip)
            if pod.cred_key != want:
                try:
                    pod.cred_slot = self.sink.acquire(pod.uid, self.request_factory(
                        role_arn=ident.role_arn, external_id=ident.external_id or None,
                        namespace=pod.namespace, pod_name=pod.name,
                        service_account=pod.service_account, pod_ip=ip))
                    pod.cred_key = want
                except Exception as e:   # slots exhausted: stay undecided (503), retry later
                    self.counters["acquire_errors"] += 1
                    log.error("pod %s/%s: no credential slot for %s: %s",
                              pod.namespace, pod.name, ident.role_arn, e)
                    ident = None
                    self._retry.add(pod.uid)
        elif pod.cred_key is not None:
            self._gone.add(pod.uid)   # released after the table stops naming the slot
            pod.cred_key = None
            pod.cred_slot = -1
        if ident != pod.identity:
            pod.identity = ident
            self._dirty_ips.update(pod.claims)
        self._refresh_pending(pod)
