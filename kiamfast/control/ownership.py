"""Which pod owns which address on this node, and what its requests are answered with.

Every agent before kiamfast lost credentials (or handed out another pod's) in the moments
when its picture of the node was incomplete: a pod asking before its IP reached the watch,
an address reused while the API server still showed the old pod with it, a watch that
dropped and came back.  This module is the one place that decides who owns each address,
and it writes exactly that into the shared table.  It is synchronous and does no I/O
besides table writes and calls into the credential sink; `kiamfast.control.pods` feeds it
the API's pods and namespaces, the control process the container runtime's views.

Two sources, one rule each:

* **The container runtime** (`apply_runtime`, `kiamfast.control.runtime`) is the source of
  address ownership wherever it is reachable: an address belongs to the pod of the one READY
  sandbox that holds it, and to nobody else, whatever the API server says.  CNI gives a
  sandbox its address before any container of the pod starts, and a stopped sandbox no
  longer holds one; the API server learns both seconds later (reference: cri.md).  An
  address two READY sandboxes claim belongs to nobody.  Each applied view is dated by when
  its poll began (`table.set_verified`), so workers answer a connection only from a view
  begun after the connection was accepted (docs/architecture.md, "Freshness").
* **The API server** is the source of the role policy: annotations, namespaces, default
  role.  A pod the runtime shows but the watch has not delivered yet is decided from its
  sandbox's annotations (the kubelet copies the pod's), unless the policy needs a namespace
  the agent has not seen yet.  Where no runtime is configured, the API is also the source
  of ownership, with the rules below.  While a configured runtime cannot be asked, its last
  view may only take owners away: an address keeps an owner only where that view and the
  API's rules name the same pod, and only while nothing says the sandbox behind it may
  have changed (`_fallback`): where the CNI routes each pod's address to its own veth,
  the host's route to it unchanged since that view began (`RouteEvidence`,
  `kiamfast.control.cri.routes`); elsewhere, no pod of the API that could sit on an
  address unseen by both.

API ownership (only without a runtime view):

* A pod owns its addresses (`status.podIPs`, falling back to `status.podIP`) while its phase
  is Pending, Running or Unknown and it is not hostNetwork.  A terminal phase or the delete
  releases them at once; a terminating pod (deletionTimestamp) keeps them until then.
* Two pods can claim one address: the API still shows a dead pod Running after its address
  went to a new pod.  Each (pod, address) claim is keyed by the resourceVersion that first
  showed it (the watch event's, or the list's), then creationTimestamp, non-terminating over
  terminating, UID; the highest key owns the address.  An address is written to a pod's
  status only after its previous owner gave it up, so a claim seen later is newer.  A claim
  keeps its first key: a late event of an old pod never makes it newer.
* High-water mark: an address remembers the highest key that ever owned it while any pod
  still claims it, so when the new owner goes away the address becomes free, never the
  stale old pod's again.

Identity: `RolePolicy.decide` per pod; denied pods are written `POD_DENIED` (workers answer
404 at once), pods without a role `POD_NO_ROLE`, pods with a role `POD_ROLE` with the slot
the credential sink hands out (`sink.acquire`, which also starts the prefetch, before the
pod has an address).  An owner whose decision needs a namespace the agent has not seen is
written `POD_UNDECIDED` (workers wait) for at most `namespace_grace` seconds, then denied.
A pod that asks by token only (`token_only`, container_credentials/token_only.py) keeps its
role and slot for the token path, but its addresses are written `POD_DENIED` (naming its
slot, so a restarted control process finds it again); such a pod on the host network is
decided too, and owns no address.

Restarts: the model starts from what the table holds (`adopted`).  The first sync (or the
first runtime view) makes the table equal to what the model knows: every address nobody
owns any more is released, so no address keeps pointing at a credential slot that a new key
could take over (`slot_in_use` tells the credential manager which slots are still named).

Writes are batched: the mutators only record what changed; `commit()` decides identities,
writes claims before releases (a moved address is one write), releases credentials of pods
that no longer need them, publishes the status words and the runtime view's date, and calls
`notify()` once if anything changed.

What it must never do: map an address to a pod that does not own it, give an address back
to a pod that lost it, or keep an address the runtime says nobody holds.
"""
from __future__ import annotations

import ipaddress
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol

from kiamfast.control.iam.policy import IdentityKind, NamespaceRules, PodIdentity, RolePolicy
from kiamfast.table import POD_DENIED, POD_NO_ROLE, POD_ROLE, POD_UNDECIDED

log = logging.getLogger("kiamfast.ownership")


LIVE_PHASES = frozenset({"", "Pending", "Running", "Unknown"})

# Claim key: (resourceVersion that first showed it, creationTimestamp, not terminating, uid)
ClaimKey = tuple[int, str, int, str]
Written = tuple[str, int, int]          # (pod uid, pod state, credential slot)


class CredentialSink(Protocol):
    """The credential manager as the ownership model uses it."""

    def acquire(self, pod_uid: str, req: Any) -> int: ...

    def release(self, pod_uid: str) -> None: ...

    def role_of_slot(self, slot: int) -> tuple[str, str | None] | None:
        """(role ARN, external ID) of the key a slot holds, or None."""


class TableWriter(Protocol):
    """The writer half of `kiamfast.table.Table` this model uses."""

    def claim_ip(self, ip: str, pod_uid: str, pod_state: int, cred_slot: int = -1) -> None: ...

    def release_ip(self, ip: str, pod_uid: str) -> bool: ...

    def set_status(self, *, synced: bool | None = None, ready: bool | None = None,
                   pending_pods: int | None = None,
                   runtime_mode: bool | None = None) -> None: ...

    def set_verified(self, started_ns: int) -> None: ...


class SandboxLike(Protocol):
    """What the model reads of a `kiamfast.control.runtime.Sandbox`."""
    pod_uid: str
    name: str
    namespace: str
    ips: tuple[str, ...]
    annotations: Mapping[str, str]


class RuntimeViewLike(Protocol):
    """What the model reads of a `kiamfast.control.runtime.RuntimeView`."""
    started_ns: int
    owners: Mapping[str, SandboxLike]


class _Written(dict):
    """ip -> (pod uid, pod state, credential slot) as the table holds it, counting how many
    addresses name each credential slot in ``refs`` (shared with the credential manager,
    which never frees a slot an address still names)."""

    def __init__(self, items: Mapping[str, Written], refs: Counter) -> None:
        super().__init__()
        self.refs = refs
        for ip, written in items.items():
            self[ip] = written

    def __setitem__(self, ip: str, written: Written) -> None:
        old = self.get(ip)
        if old is not None:
            self.refs[old[2]] -= 1
        super().__setitem__(ip, written)
        self.refs[written[2]] += 1

    def __delitem__(self, ip: str) -> None:
        self.refs[self[ip][2]] -= 1
        super().__delitem__(ip)

    def pop(self, ip: str, default: Any = None) -> Any:
        if ip not in self:
            return default
        written = self[ip]
        del self[ip]
        return written


class HostRoutesLike(Protocol):
    """The kernel's second witness while the runtime cannot be asked
    (`kiamfast.control.cri.routes.RouteWatch`)."""
    generation: int   # bumped whenever an answer of path_kept may have changed

    def path_kept(self, ip: str, since_ns: int) -> bool | None:
        """True: replies to `ip` have gone down one pod veth ever since `since_ns`; False:
        its host route or link changed since; None: no evidence either way."""


def _default_request_factory(**fields: Any) -> Any:
    from kiamfast.control.iam.keys import CredentialRequest
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
    from_api: bool = True                 # False: known only from a runtime sandbox
    rv: int = 0
    created: str = ""
    phase: str = ""
    host_network: bool = False
    terminating: bool = False
    annotations: Mapping[str, str] = field(default_factory=dict)
    service_account: str = ""
    token_only: bool = False              # asks by token: the metadata path refuses it
    api_ips: tuple[str, ...] = ()
    identity: PodIdentity | None = None   # None: undecided (not yet evaluated / ns unknown)
    undecided_since: float | None = None
    cred_slot: int = -1
    cred_key: tuple[str, str, str | None] | None = None   # (role, external id, ip) acquired
    claims: dict[str, ClaimKey] = field(default_factory=dict)   # API ownership only

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES and not self.host_network

    @property
    def decided(self) -> bool:
        """Does it get a role decision and credentials?  Live pods, and a hostNetwork pod
        that asks by token only: it owns no address (the node's is not its own), so the
        metadata path never serves it, but its token names it."""
        return self.live or (self.host_network and self.token_only
                             and self.phase in LIVE_PHASES)


class RouteEvidence:
    """What the host's routes say about each address of the runtime's last view, as of the
    last commit: True (the path to it is unchanged since that view began), False (it
    changed), None (no evidence).  Asked again only when the routes or the view changed."""

    def __init__(self, routes: HostRoutesLike | None) -> None:
        self.routes = routes
        self._kept: dict[str, bool | None] = {}
        self._asked: tuple[int, int] | None = None   # (routes generation, since_ns)

    def kept(self, ip: str) -> bool | None:
        return self._kept.get(ip)

    def refresh(self, addresses: Iterable[str], *, since_ns: int) -> set[str]:
        """Ask again for every address; returns those whose answer changed."""
        if self.routes is None:
            return set()
        asked = (self.routes.generation, since_ns)
        if asked == self._asked:
            return set()
        self._asked = asked
        kept = {ip: self.routes.path_kept(ip, since_ns) for ip in addresses}
        changed = {ip for ip in kept.keys() | self._kept.keys()
                   if kept.get(ip) != self._kept.get(ip)}
        self._kept = kept
        return changed

    def forget(self) -> None:
        """A new outage: nothing asked yet."""
        self._kept, self._asked = {}, None


class Ownership:
    """The node's pods, their identities and their addresses; the table's only writer of
    IP slots.  Feed it events and runtime views, then `commit()`."""

    def __init__(
        self,
        *,
        policy: RolePolicy,
        table: TableWriter,
        sink: CredentialSink,
        notify: Callable[[], None] = lambda: None,
        request_factory: Callable[..., Any] = _default_request_factory,
        namespace_grace: float = 10.0,
        tombstones: int = 16384,
        clock: Callable[[], float] = time.monotonic,
        adopted: Mapping[str, Written] | None = None,
        expect_runtime: bool = False,
        token_only: Callable[[Mapping[str, Any]], bool] = lambda spec: False,
        slot_refs: Counter | None = None,
        routes: HostRoutesLike | None = None,
    ) -> None:
        self.policy = policy
        self.token_only = token_only   # container_credentials/token_only.py
        self.table = table
        self.sink = sink
        self.notify = notify
        self.request_factory = request_factory
        self.namespace_grace = namespace_grace
        self.clock = clock
        self.pods: dict[str, _Pod] = {}              # from the API
        self.sandbox_pods: dict[str, _Pod] = {}      # shown by the runtime, not (yet) the API
        self.namespaces: dict[str, NamespaceRules] = {}
        self._by_ns: dict[str, set[str]] = {}
        self._claimants: dict[str, set[str]] = {}    # API ownership: ip -> claiming uids
        self._hw: dict[str, ClaimKey] = {}
        # What the table holds: at start whatever a previous control process left there.
        self.slot_refs: Counter = slot_refs if slot_refs is not None else Counter()
        self._written = _Written(adopted or {}, self.slot_refs)
        self._reconciled = not self._written
        self._runtime: dict[str, str] | None = None  # ip -> uid of the last view; None: none
        self._expect_runtime = expect_runtime        # runtime_mode: workers need a poll
        # A runtime is configured but has not answered yet: nothing is decided by the API's
        # rules meanwhile, and workers wait for the first poll (runtime_mode is published).
        self._awaiting_runtime = expect_runtime
        # The last poll attempt failed: the fallback decides (`_fallback`): an address has
        # an owner only where the last view and the API name the same pod; workers answer
        # a connection only after an attempt begun after it (success or failure) was
        # applied.
        self._runtime_stale = False
        self._newcomer_unplaced = False             # the fallback's guard, as last applied
        self._route_evidence = RouteEvidence(routes)  # the kernel's word per agreed address
        self._failed_ns = 0
        self._published_failed = 0
        self._runtime_ips: dict[str, set[str]] = {}  # uid -> ips, the same view inverted
        self._sandboxes: dict[str, SandboxLike] = {}  # uid -> its READY sandbox
        self._last_owners: object = None             # the last view's owners, as handed over
        self._verified_ns = 0                        # date of the view to publish
        self._published_verified = 0
        self._published_mode: bool | None = None
        # uid -> credential slot of a role a previous control process decided: stands for a
        # pod whose namespace the agent has not seen yet, until the API can overrule it (the
        # namespace arrives, or the watch has synced without it).  Only roles: an adopted
        # denial is no current evidence, so such a pod waits like any other whose namespace
        # is unknown.  A denied address naming a slot was a pod served by token only.
        self._adopted_decisions: dict[str, int] = {
            uid: slot for uid, state, slot in self._written.values()
            if state in (POD_ROLE, POD_DENIED) and slot >= 0}
        self._adopted_token_only = {uid for uid, state, slot in self._written.values()
                                    if state == POD_DENIED and slot >= 0}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._tombstone_cap = tombstones
        self._dirty_ips: set[str] = set()
        self._dirty_pods: set[str] = set()
        self._gone: set[str] = set()           # pods whose credentials to release after writes
        self._pending: set[str] = set()
        self._retry: set[str] = set()          # pods whose credential acquire failed
        self._published: tuple[int, bool] | None = None
        self._synced = False
        self.counters: dict[str, int] = {
            "claims": 0, "releases": 0, "commits": 0, "stale_events": 0, "displaced": 0,
            "table_full": 0, "acquire_errors": 0, "runtime_views": 0, "runtime_only_pods": 0,
            "reconciled_releases": 0,
        }

    # ---- queries ------------------------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced

    @property
    def runtime_mode(self) -> bool:
        """Whether workers must wait for a runtime poll attempt newer than their connection."""
        return self._expect_runtime

    @property
    def pending_pods(self) -> int:
        return len(self._pending)

    def owner(self, ip: str) -> str | None:
        """The pod UID the table maps `ip` to (after the last commit), or None."""
        c = canonical_ip(ip)
        w = self._written.get(c) if c else None
        return w[0] if w else None

    def mapping(self) -> dict[str, Written]:
        """ip -> (uid, pod state, credential slot) as written to the table."""
        return dict(self._written)

    def slot_in_use(self, slot: int) -> bool:
        """Does any address in the table point at this credential slot?"""
        return self.slot_refs[slot] > 0

    def denials(self) -> dict[str, tuple[str, str]]:
        """pod uid -> (role ARN, namespace) of the pods the table denies by their namespace's
        rules: workers answer them with kube2iam's text."""
        out = {}
        for uid, state, _ in self._written.values():
            pod = self._pod(uid) if state == POD_DENIED else None
            if (pod is not None and pod.identity is not None and pod.identity.role_arn
                    and pod.identity.kind == IdentityKind.DENIED):
                out[uid] = (pod.identity.role_arn, pod.namespace)
        return out

    def debug_store(self) -> dict[str, Any]:
        """kube2iam's /debug/store view: namespaceByIP, rolesByIP, rolesByNamespace."""
        ns_by_ip: dict[str, str] = {}
        roles_by_ip: dict[str, str] = {}
        for ip, (uid, _, _) in sorted(self._written.items()):
            pod = self._pod(uid)
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
        if pod is not None and rv and rv < pod.rv:
            self.counters["stale_events"] += 1
            return
        if pod is None:
            pod = _Pod(uid=uid, namespace=meta.get("namespace") or "", name=meta.get("name") or "")
            self.pods[uid] = pod
            self._by_ns.setdefault(pod.namespace, set()).add(uid)
            if self.sandbox_pods.pop(uid, None) is not None:
                self._dirty_ips.update(self._runtime_ips.get(uid, ()))
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        annotations = meta.get("annotations") or {}
        was_decided = pod.decided
        old_ann = (pod.annotations.get(self.policy.role_key),
                   pod.annotations.get(self.policy.external_id_key))
        was_token_only = pod.token_only
        pod.rv = rv
        pod.created = meta.get("creationTimestamp") or pod.created
        pod.phase = status.get("phase") or ""
        pod.host_network = bool(spec.get("hostNetwork"))
        pod.terminating = bool(meta.get("deletionTimestamp"))
        pod.annotations = annotations
        pod.service_account = spec.get("serviceAccountName") or spec.get("serviceAccount") or ""
        pod.token_only = self.token_only(spec)
        if pod.token_only and not was_token_only:
            log.info("pod %s/%s asks by token: the metadata path refuses it credentials",
                     pod.namespace, pod.name)
        pod.api_ips = pod_ips(obj)
        new_ann = (annotations.get(self.policy.role_key),
                   annotations.get(self.policy.external_id_key))
        if (pod.identity is None or was_decided != pod.decided or old_ann != new_ann
                or was_token_only != pod.token_only):
            self._dirty_pods.add(uid)
        self._set_claims(pod, seen=rv if seen is None else seen)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        """A DELETED pod: it loses its addresses (only where it still owns them)."""
        uid = (obj.get("metadata") or {}).get("uid") or ""
        if uid:
            self._remove(uid)

    def replace_pods(self, items: Iterable[Mapping[str, Any]], *, list_rv: int = 0) -> None:
        """A full list (initial or relist) at `list_rv`: adds and updates first, then the pods
        that are no longer listed are removed."""
        items = list(items)
        if not list_rv:
            list_rv = max([0] + [resource_version(o) for o in items])
        listed: set[str] = set()
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid")
            if uid:
                listed.add(uid)
                self.apply_pod(obj, seen=list_rv)
        for uid in [u for u in self.pods if u not in listed]:
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
                self._dirty_pods.update(u for u, p in self.sandbox_pods.items()
                                        if p.namespace == name)

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

    # ---- the container runtime -----------------------------------------------------------------

    def apply_runtime(self, view: RuntimeViewLike) -> None:
        """A runtime poll: from now on its READY sandboxes own the node's addresses."""
        if (view.owners is self._last_owners and self._runtime is not None
                and not self._runtime_stale):
            # The same READY set as the last poll (the client hands back the same objects):
            # nothing changes hands, only the view's date moves on.
            self._verified_ns = max(self._verified_ns, view.started_ns)
            self.counters["runtime_views"] += 1
            return
        self._last_owners = view.owners
        owners: dict[str, str] = {}
        by_uid: dict[str, set[str]] = {}
        sandboxes: dict[str, SandboxLike] = {}
        for ip, sandbox in view.owners.items():
            c = canonical_ip(ip)
            if c is None or not sandbox.pod_uid:
                continue
            owners[c] = sandbox.pod_uid
            by_uid.setdefault(sandbox.pod_uid, set()).add(c)
            sandboxes[sandbox.pod_uid] = sandbox
            pod = self.pods.get(sandbox.pod_uid)
            if pod is None:
                self._sandbox_pod(sandbox)
            elif pod.cred_key is not None and pod.cred_key[2] is None:
                self._dirty_pods.add(pod.uid)   # tell the credential manager its address
        for uid in [u for u in self.sandbox_pods if u not in by_uid]:
            self._forget_sandbox_pod(uid)
        if self._runtime is None or self._runtime_stale or self._awaiting_runtime:
            # From the API's rules to the runtime's: every address may change hands.
            log.info("addresses now follow the container runtime (%d sandboxes)", len(by_uid))
            self._dirty_ips.update(self._written)
            self._dirty_ips.update(self._claimants)
            self._dirty_ips.update(owners)
            if self._runtime:
                self._dirty_ips.update(self._runtime)
        else:
            for ip in owners.keys() | self._runtime.keys():
                if owners.get(ip) != self._runtime.get(ip):
                    self._dirty_ips.add(ip)
        self._runtime = owners
        self._expect_runtime = True
        self._awaiting_runtime = False
        self._runtime_stale = False
        self._runtime_ips = by_uid
        self._sandboxes = sandboxes
        self._verified_ns = max(self._verified_ns, view.started_ns)
        self.counters["runtime_views"] += 1
        self._reconcile()

    def runtime_failed(self, started_ns: int) -> None:
        """A poll attempt begun at `started_ns` failed.  Until the runtime answers again an
        address has an owner only where its last view and the API agree (`_fallback`)."""
        self._failed_ns = max(self._failed_ns, started_ns)
        if self._runtime_stale:
            return
        log.warning("the container runtime cannot be asked: an address keeps its owner only "
                    "where the runtime's last view and the API server name the same pod")
        self._expect_runtime = True
        self._runtime_stale = True
        self._awaiting_runtime = False
        if self._runtime is None:
            # No view in this process yet: what the table holds (a previous process's
            # decisions) stands in for the last view, with the same limits.
            self._runtime = {ip: uid for ip, (uid, _, _) in self._written.items()}
            for ip, uid in self._runtime.items():
                self._runtime_ips.setdefault(uid, set()).add(ip)
        self._newcomer_unplaced = self._unplaced_newcomer()
        self._route_evidence.forget()
        self._dirty_ips.update(self._written)
        self._dirty_ips.update(self._claimants)
        self._dirty_ips.update(self._runtime)
        self._reconcile()

    def _sandbox_pod(self, sandbox: SandboxLike) -> None:
        pod = self.sandbox_pods.get(sandbox.pod_uid)
        annotations = dict(sandbox.annotations)
        if pod is None:
            # A sandbox carries no environment: a pod the previous process served by token
            # only stays so until the API shows its spec.
            pod = _Pod(uid=sandbox.pod_uid, namespace=sandbox.namespace, name=sandbox.name,
                       from_api=False, phase="Running", annotations=annotations,
                       token_only=sandbox.pod_uid in self._adopted_token_only)
            self.sandbox_pods[pod.uid] = pod
            self._dirty_pods.add(pod.uid)
            self.counters["runtime_only_pods"] += 1
        elif pod.annotations != annotations:
            pod.annotations = annotations
            self._dirty_pods.add(pod.uid)

    def _forget_sandbox_pod(self, uid: str) -> None:
        pod = self.sandbox_pods.pop(uid)
        self._dirty_ips.update(self._runtime_ips.get(uid, ()))
        if pod.cred_key is not None:
            self._gone.add(uid)
        self._dirty_pods.discard(uid)

    # ---- time and sync ------------------------------------------------------------------------

    def expire(self) -> None:
        """Retry failed credential acquires; deny pods whose namespace stayed unknown past the
        grace period.  Call every second or so."""
        now = self.clock()
        self._dirty_pods.update(u for u in self._retry if self._pod(u) is not None)
        self._retry.clear()
        for uid, pod in [*self.pods.items(), *self.sandbox_pods.items()]:
            if (pod.undecided_since is not None
                    and now - pod.undecided_since > self.namespace_grace):
                self._dirty_pods.add(uid)

    def set_synced(self, synced: bool) -> None:
        self._synced = synced
        if synced:
            # The API can overrule a previous process's decisions from now on.
            self._dirty_pods.update(u for u in self._adopted_decisions if self._pod(u))
            self._adopted_decisions.clear()
            self._reconcile()

    def _reconcile(self) -> None:
        """Once the model knows the node (synced, or a runtime view), every address a
        previous control process left in the table is decided again."""
        if not self._reconciled:
            self._reconciled = True
            self._dirty_ips.update(self._written)

    # ---- commit -------------------------------------------------------------------------------

    def commit(self) -> bool:
        """Write everything recorded since the last commit; returns whether the table changed."""
        changed = False
        for uid in sorted(self._dirty_pods):
            pod = self._pod(uid)
            if pod is not None:
                self._decide(pod)
        self._dirty_pods.clear()
        if self._runtime_stale:
            unplaced = self._unplaced_newcomer()
            if unplaced != self._newcomer_unplaced:
                self._newcomer_unplaced = unplaced
                self._dirty_ips.update(self._runtime)   # the guard moves every agreement
            self._dirty_ips.update(self._route_evidence.refresh(self._runtime or {},
                                                                since_ns=self._verified_ns))
        claims: list[tuple[str, Written]] = []
        releases: list[tuple[str, str]] = []
        for ip in sorted(self._dirty_ips):
            # The API's owner, kept up to date (high-water marks) even while the runtime
            # decides: the fallback needs it the moment a poll fails.
            want = self._desired(ip, self._api_owner(ip))
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
            if self._pod(uid) is None or self._pod(uid).cred_key is None:
                self.sink.release(uid)
        self._gone.clear()
        status = (len(self._pending), self._synced)
        if status != self._published:
            self.table.set_status(pending_pods=status[0], synced=status[1])
            self._published = status
            changed = True
        # The view's date last: workers trust the slots above for connections older than it;
        # after a failed attempt, the date of that attempt (the slots follow the fallback).
        if self._runtime_stale:
            if self._failed_ns > self._published_failed:
                self.table.set_failed(self._failed_ns)
                self._published_failed = self._failed_ns
                changed = True
        elif self._runtime is not None and self._verified_ns > self._published_verified:
            self.table.set_verified(self._verified_ns)
            self._published_verified = self._verified_ns
            changed = True
        if self._published_mode != self.runtime_mode:
            self.table.set_status(runtime_mode=self.runtime_mode)
            self._published_mode = self.runtime_mode
            changed = True
        self.counters["commits"] += 1
        if changed:
            self.notify()
        return changed

    # ---- internals ----------------------------------------------------------------------------

    def _pod(self, uid: str) -> _Pod | None:
        return self.pods.get(uid) or self.sandbox_pods.get(uid)

    def _ips_of(self, pod: _Pod) -> Iterable[str]:
        """The addresses this pod owns under the current source of ownership."""
        if self._runtime is not None:
            if self._runtime_stale:
                return set(self._runtime_ips.get(pod.uid, ())) | set(pod.claims)
            return self._runtime_ips.get(pod.uid, ())
        return pod.claims

    def _remove(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
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
        if uid in self._sandboxes and not self._runtime_stale:
            # Deleted from the API while its sandbox still runs (a forced delete): the
            # processes asking from its address are still this pod's.  Not from a stale
            # view: the API's delete is the fresher evidence.
            self._sandbox_pod(self._sandboxes[uid])

    def _set_claims(self, pod: _Pod, *, seen: int) -> None:
        """Make the pod's API claims match its published addresses; new claims are keyed at
        `seen`."""
        wanted = set(pod.api_ips) if pod.live else set()
        for ip in list(pod.claims):
            if ip not in wanted:
                self._drop_claim(pod, ip)
        rank = 0 if pod.terminating else 1
        for ip in wanted:
            if ip not in pod.claims:
                pod.claims[ip] = (seen, pod.created, rank, pod.uid)
                self._claimants.setdefault(ip, set()).add(pod.uid)
                self._dirty_ips.add(ip)
        if pod.cred_key is not None and pod.cred_key[2] is None and pod.api_ips:
            self._dirty_pods.add(pod.uid)   # tell the credential manager the pod's address
        self._refresh_pending(pod)

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
        if pod.from_api and pod.live and (not pod.api_ips or pod.identity is None):
            self._pending.add(pod.uid)
        else:
            self._pending.discard(pod.uid)

    def _api_owner(self, ip: str) -> str | None:
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

    def _desired(self, ip: str, api_owner: str | None) -> Written | None:
        if self._awaiting_runtime:
            return self._written.get(ip)       # the runtime decides, once it answers
        if self._runtime is None:
            uid = api_owner
        elif self._runtime_stale:
            return self._fallback(ip, api_owner)
        else:
            uid = self._runtime.get(ip)
        if uid is None:
            if not self._reconciled:
                return self._written.get(ip)   # a restart: keep serving until we know
            return None
        return self._entry(uid)

    def _fallback(self, ip: str, api_owner: str | None) -> Written | None:
        """Who owns `ip` while the runtime cannot be asked.

        Its last view is old evidence: the agent's link to the runtime can break while the
        kubelet goes on stopping and starting sandboxes, so that view may only ever take an
        owner away.  The address keeps an owner only where the last view and the API name
        the same pod, and only while nothing says the sandbox behind it may have changed
        (`_agreement_holds`).  Otherwise nobody owns the address: it is written undecided
        (workers wait, then answer 503: the SDK retries) until a poll succeeds.  Where
        neither names a pod, it is free (404)."""
        seen = self._runtime.get(ip) if self._runtime is not None else None
        if seen is None and api_owner is None:
            return None
        if seen == api_owner and self._agreement_holds(ip):
            return self._entry(seen)
        return (api_owner or seen, POD_UNDECIDED, -1)   # type: ignore[return-value]

    def _agreement_holds(self, ip: str) -> bool:
        """Does an address the last view and the API agree on keep its owner?

        The host's route to it decides where it has one (`RouteEvidence`): unchanged since
        the last view began, the replies still go to that view's sandbox, whoever else
        started meanwhile; changed, the sandbox may have changed.  Without that evidence
        (bridge CNIs, policy routing that may divert replies) the strict rule: only while
        no pod of the node could hold an address unseen by both (a pod the last view did
        not show, whose address the API has not published: it may sit on an address a dead
        pod freed while the API still shows the dead one).  That pod's own requests wait
        either way (pending_pods)."""
        kept = self._route_evidence.kept(ip)
        if kept is not None:
            return kept
        return not self._newcomer_unplaced

    def _unplaced_newcomer(self) -> bool:
        """A live pod of the API that the last view did not show and whose address the API
        has not published yet."""
        return any(pod.live and not pod.api_ips and uid not in self._runtime_ips
                   for uid, pod in self.pods.items())

    def _entry(self, uid: str) -> Written | None:
        """The table entry of an address `uid` owns."""
        pod = self._pod(uid)
        if pod is None:
            return None
        ident = pod.identity
        if ident is None:
            return (uid, POD_UNDECIDED, -1)   # known owner, policy still open: workers wait
        if ident.kind == IdentityKind.ROLE:
            # Its credentials are served by token only (the slot stays the pod's).
            state = POD_DENIED if pod.token_only else POD_ROLE
            return (uid, state, pod.cred_slot)
        if ident.kind == IdentityKind.NO_ROLE:
            return (uid, POD_NO_ROLE, -1)
        return (uid, POD_DENIED, -1)

    def _adopted_identity(self, pod: _Pod, ident: PodIdentity) -> PodIdentity | None:
        """What a previous control process decided for this pod, for as long as the API
        cannot overrule it (the pod's namespace not seen, the watch not synced: a restart
        while the API server is down).  Only a role, and only if the credential slot it
        wrote holds this very role: adopted evidence may keep a pod served, never turn it
        away (a denial it wrote is not current: the pod waits instead, as any pod whose
        namespace is unknown)."""
        slot = self._adopted_decisions.get(pod.uid) if not self._synced else None
        if slot is None:
            return None
        external_id = (pod.annotations.get(self.policy.external_id_key) or "").strip()
        if self.sink.role_of_slot(slot) != (ident.role_arn, external_id or None):
            return None
        return PodIdentity.role(ident.role_arn, external_id)

    def _decide(self, pod: _Pod) -> None:
        if not pod.decided:
            # Terminal (or hostNetwork, unless by token): no addresses, no credentials.
            if pod.cred_key is not None:
                self._gone.add(pod.uid)
                pod.cred_key = None
                pod.cred_slot = -1
            pod.identity = PodIdentity.denied("not running")
            pod.undecided_since = None
            self._dirty_ips.update(self._ips_of(pod))
            self._refresh_pending(pod)
            return
        self._gone.discard(pod.uid)
        rules = self.namespaces.get(pod.namespace)
        ident = self.policy.decide(pod.annotations, rules, namespace=pod.namespace, pod=pod.name)
        adopted = None
        if rules is None and ident.kind == IdentityKind.DENIED and ident.namespace_unknown:
            adopted = self._adopted_identity(pod, ident)
        if adopted is not None:
            ident = adopted
        elif rules is None and ident.kind == IdentityKind.DENIED and ident.namespace_unknown:
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
            ips = list(self._ips_of(pod)) or ([] if pod.host_network else list(pod.api_ips))
            ip = sorted(ips)[0] if ips else None
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
        pod.identity = ident
        self._dirty_ips.update(self._ips_of(pod))
        self._refresh_pending(pod)
