"""The node model: the node's pods, their decisions and their addresses, written to the table.

Every agent before kiamfast lost credentials (or handed out another pod's) in the moments
when its picture of the node was incomplete: a pod asking before its IP reached the watch,
an address reused while the API server still showed the old pod with it, a watch that
dropped and came back.  This is the one place that decides who owns each address (the
sources, merged by :mod:`.merge`) and what its requests get (:mod:`.decisions`), and it
writes exactly that into the table (:class:`~kiamfast.control.publish.ip_slots
.AddressTable`).  Synchronous, no I/O but table writes and calls into the credential sink;
the API source feeds it pods and namespaces, the control process the runtime's views (a
pod only the runtime shows is recorded by :mod:`.sandbox_pods`).

Table entries: denied pods ``POD_DENIED`` (workers answer 404 at once), pods without a role
``POD_NO_ROLE``, pods with a role ``POD_ROLE`` with the slot the credential sink hands out
(:mod:`.credential_holds`: acquired before the pod has an address), owners not decided yet
``POD_UNDECIDED`` (workers wait).  A pod that asks by token only
(container_credentials/token_only.py) keeps its role and slot for the token path, but its
addresses are written ``POD_DENIED`` naming its slot (so a restarted control process finds
it again); such a pod on the host network is decided too, and owns no address.

Restarts: the model starts from what the table holds (``adopted``).  The first sync (or the
first runtime view) makes the table equal to what the model knows: every address nobody owns
any more is released.

Writes are batched: the mutators record what changed; :meth:`NodeModel.commit` decides,
writes claims before releases, releases credentials of pods that no longer need them, then
publishes the status words and the runtime view's date, and calls ``notify()`` once if
anything changed (:mod:`.report` reads denials, /debug/store and counters from it).  What
it must never do: map an address to a pod that does not own it, give an address back to a
pod that lost it, or keep an address the runtime says nobody holds.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kiamfast.control.mappings.canonical import pod_ips, resource_version
from kiamfast.control.mappings.api_owners import ApiOwners
from kiamfast.control.mappings.credential_holds import CredentialHolds, CredentialSink
from kiamfast.decisions import IdentityKind, PodDecision, PodIdentity
from kiamfast.control.mappings.decider import Decider, PodRecord
from kiamfast.control.mappings.merge import KEEP, Merge, Owner, Undecided
from kiamfast.control.mappings.policy import NamespaceRules, RolePolicy
from kiamfast.control.mappings.runtime_owners import (AddressProof, RuntimeOwners,
                                                      RuntimeViewLike)
from kiamfast.control.mappings.sandbox_pods import SandboxPods
from kiamfast.control.publish.ip_slots import AddressTable, TableWriter, Written
from kiamfast.table import POD_DENIED, POD_NO_ROLE, POD_ROLE, POD_UNDECIDED

log = logging.getLogger("kiamfast.ownership")


class NodeModel:
    """Feed it events and runtime views, then ``commit()``."""

    def __init__(self, *, policy: RolePolicy, table: TableWriter, sink: CredentialSink,
                 notify: Callable[[], None] = lambda: None, namespace_grace: float = 10.0,
                 clock: Callable[[], float] = time.monotonic,
                 adopted: Mapping[str, Written] | None = None, expect_runtime: bool = False,
                 token_only: Callable[[Mapping[str, Any]], bool] = lambda spec: False,
                 slot_refs: Counter | None = None,
                 proof: AddressProof | None = None) -> None:
        self.policy = policy
        self.token_only = token_only   # container_credentials/token_only.py
        self.holds = CredentialHolds(sink)
        self.notify = notify
        self.clock = clock
        self.pods: dict[str, PodRecord] = {}              # from the API
        self.namespaces: dict[str, NamespaceRules] = {}
        self._by_ns: dict[str, set[str]] = {}
        self.addresses = AddressTable(table, adopted=adopted or {}, refs=slot_refs)
        self.slot_refs = self.addresses.refs
        written = self.addresses.written
        self.api = ApiOwners()
        self.runtime = RuntimeOwners(expected=expect_runtime, proof=proof)
        self.merge = Merge(runtime=self.runtime)
        self.merge.reconciled = not written
        # A denied address naming a slot was a pod served by token only (see the docstring).
        self.decider = Decider(policy=policy, namespace_grace=namespace_grace, clock=clock,
                               role_of_slot=lambda slot: sink.role_of_slot(slot),
                               adopted={uid: slot for uid, state, slot in written.values()
                                        if state in (POD_ROLE, POD_DENIED) and slot >= 0})
        self.sandbox_pods = SandboxPods(  # the runtime's pods, not (yet) the API's
            adopted_token_only={uid for uid, state, slot in written.values()
                                if state == POD_DENIED and slot >= 0})
        # Every pod the model removed was last written before this resourceVersion: a pod it
        # does not know whose object is older is a removed pod's late copy (`_remove`).
        self._removed_before = 0
        self._dirty_ips: set[str] = set()
        self._dirty_pods: set[str] = set()
        self._pending: set[str] = set()
        self.synced = False
        self.counts = {"commits": 0, "stale_events": 0, "acquire_errors": 0, "runtime_views": 0}

    # ---- what the rest of the agent reads -----------------------------------------------------

    @property
    def runtime_mode(self) -> bool:
        """Whether workers must wait for a runtime poll attempt newer than their connection."""
        return self.runtime.expected

    @property
    def unproven_addresses(self) -> int:
        """Addresses a sandbox or the API claims that the kernel does not show there."""
        return len(self.runtime.claims)

    @property
    def pending_pods(self) -> int:
        return len(self._pending)

    def decision(self, uid: str) -> PodDecision | None:
        """The pod's current decision (both answer paths read this), or None if unknown."""
        pod = self._pod(uid)
        if pod is None:
            return None
        return PodDecision(uid=uid, namespace=pod.namespace, name=pod.name,
                           service_account=pod.service_account, identity=pod.identity,
                           cred_slot=pod.cred_slot, token_only=pod.token_only,
                           host_network=pod.host_network, decided=pod.decided,
                           address=self._address(pod), source=pod.source)

    # ---- pods and namespaces from the API -----------------------------------------------------

    def apply_pod(self, obj: Mapping[str, Any], *, seen: int | None = None) -> None:
        """An ADDED/MODIFIED pod (watch event, or list item with ``seen`` = the list's RV)."""
        meta = obj.get("metadata") or {}
        uid = meta.get("uid") or ""
        if not uid:
            return
        rv = resource_version(obj)
        pod = self.pods.get(uid)
        if pod is None and rv and rv < self._removed_before:
            self.counts["stale_events"] += 1     # a removed pod's late copy: never back
            return
        if pod is not None and rv and rv < pod.rv:
            self.counts["stale_events"] += 1
            return
        if pod is None:
            pod = PodRecord(uid=uid, namespace=meta.get("namespace") or "",
                            name=meta.get("name") or "")
            self.pods[uid] = pod
            self._by_ns.setdefault(pod.namespace, set()).add(uid)
            if self.sandbox_pods.forget(uid) is not None:
                self._dirty_ips.update(self.runtime.ips.get(uid, ()))
        spec = obj.get("spec") or {}
        annotations = meta.get("annotations") or {}
        keys = (self.policy.role_key, self.policy.external_id_key)
        before = (pod.decided, pod.token_only, tuple(pod.annotations.get(k) for k in keys))
        pod.rv = rv
        pod.created = meta.get("creationTimestamp") or pod.created
        pod.phase = (obj.get("status") or {}).get("phase") or ""
        pod.host_network = bool(spec.get("hostNetwork"))
        pod.terminating = bool(meta.get("deletionTimestamp"))
        pod.annotations = annotations
        pod.service_account = spec.get("serviceAccountName") or spec.get("serviceAccount") or ""
        pod.token_only = self.token_only(spec)
        if pod.token_only and not before[1]:
            log.info("pod %s/%s asks by token: the metadata path refuses it credentials",
                     pod.namespace, pod.name)
        pod.api_ips = pod_ips(obj)
        after = (pod.decided, pod.token_only, tuple(annotations.get(k) for k in keys))
        if pod.identity is None or before != after:
            self._dirty_pods.add(uid)
        self._dirty_ips |= self.api.set_claims(pod, seen=rv if seen is None else seen)
        if pod.cred_key is not None and pod.cred_key[2] is None and pod.api_ips:
            self._dirty_pods.add(uid)   # tell the credential manager the pod's address
        self._refresh_pending(pod)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        """A DELETED pod: it loses its addresses (only where it still owns them)."""
        uid = (obj.get("metadata") or {}).get("uid") or ""
        if uid:
            self._remove(uid, removed_rv=resource_version(obj))

    def replace_pods(self, items: Iterable[Mapping[str, Any]], *, list_rv: int = 0) -> None:
        """A full list (initial or relist) at ``list_rv``: adds and updates first, then the
        pods that are no longer listed are removed."""
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
            self._remove(uid, removed_rv=list_rv)   # gone by then: deleted at or before it

    def apply_namespace(self, obj: Mapping[str, Any]) -> None:
        """A namespace's rules (a deleted namespace keeps them: its pods' deletes may come
        later, and their identity must not flip meanwhile)."""
        meta = obj.get("metadata") or {}
        name = meta.get("name") or ""
        if not name:
            return
        rules = self.policy.namespace_rules(name, meta.get("annotations") or {})
        if self.namespaces.get(name) != rules:
            self.namespaces[name] = rules
            if self.policy.uses_namespaces:
                self._dirty_pods.update(self._by_ns.get(name, ()))
                self._dirty_pods.update(self.sandbox_pods.in_namespace(name))

    def replace_namespaces(self, items: Iterable[Mapping[str, Any]]) -> None:
        names = set()
        for obj in items:
            names.add((obj.get("metadata") or {}).get("name") or "")
            self.apply_namespace(obj)
        for name in list(self.namespaces):
            if name not in names and not self._by_ns.get(name):
                del self.namespaces[name]

    # ---- the container runtime ----------------------------------------------------------------

    def apply_runtime(self, view: RuntimeViewLike) -> None:
        """A runtime poll: from now on its READY sandboxes own the node's addresses."""
        self.counts["runtime_views"] += 1
        if self.runtime.unchanged(view):
            return
        old_ips = self.runtime.ips
        dirty, everything = self.runtime.apply(view)
        self._dirty_ips |= dirty
        if everything:
            self._dirty_ips |= set(self.addresses.written) | set(self.api.claimants)
        for uid, sandbox in self.runtime.sandboxes.items():
            pod = self.pods.get(uid)
            if pod is None:
                if self.sandbox_pods.show(sandbox):
                    self._dirty_pods.add(uid)
            elif pod.cred_key is not None and pod.cred_key[2] is None:
                self._dirty_pods.add(uid)   # tell the credential manager its address
        for uid in [u for u in self.sandbox_pods.records if u not in self.runtime.sandboxes]:
            pod = self.sandbox_pods.records.pop(uid)   # its sandbox went
            self._dirty_ips.update(old_ips.get(uid, ()))
            self.holds.forget(pod)
            self._dirty_pods.discard(uid)
        self._reconcile()

    def runtime_failed(self, started_ns: int) -> None:
        """A poll attempt begun at ``started_ns`` failed: the last view stands, as far as
        the kernel still proves it."""
        adopted = {ip: uid for ip, (uid, _, _) in self.addresses.written.items()}
        if not self.runtime.fail(started_ns, adopted):
            return
        self._dirty_ips |= (set(self.addresses.written) | set(self.api.claimants)
                            | set(self.runtime.owners or ()) | set(self.runtime.claims))
        self._reconcile()

    def kernel_changed(self) -> None:
        """The kernel's word on which namespace holds which address moved on: every
        address of the runtime's last view is proven again."""
        if self.runtime.owners is not None and not self.runtime.awaiting:
            self._dirty_ips |= self.runtime.prove()

    # ---- time and sync ------------------------------------------------------------------------

    def expire(self) -> None:
        """Retry failed credential acquires; deny pods whose namespace stayed unknown past the
        grace period.  Call every second or so."""
        now = self.clock()
        self._dirty_pods.update(u for u in self.holds.take_retries() if self._pod(u) is not None)
        for uid, pod in [*self.pods.items(), *self.sandbox_pods.records.items()]:
            if self.decider.waited_too_long(pod, now):
                self._dirty_pods.add(uid)

    def set_synced(self, synced: bool) -> None:
        self.synced = self.decider.synced = synced
        if synced:
            # The API can overrule a previous process's decisions from now on.
            self._dirty_pods.update(u for u in self.decider.adopted if self._pod(u))
            self.decider.adopted.clear()
            self._reconcile()

    def _reconcile(self) -> None:
        """Once the model knows the node (synced, or a runtime view), every address a
        previous control process left in the table is decided again."""
        if not self.merge.reconciled:
            self.merge.reconciled = True
            self._dirty_ips.update(self.addresses.written)

    # ---- commit -------------------------------------------------------------------------------

    def commit(self) -> bool:
        """Write everything recorded since the last commit; returns whether the table changed."""
        for uid in sorted(self._dirty_pods):
            pod = self._pod(uid)
            if pod is not None:
                self._decide(pod)
        self._dirty_pods.clear()
        rt = self.runtime
        # The API's owner, kept up to date (high-water marks) even while the runtime
        # decides: the fallback needs it the moment a poll fails.
        wanted = {ip: self._wanted(ip, self.merge.owner(ip, self.api.owner(ip, self.pods)))
                  for ip in self._dirty_ips}
        self._dirty_ips.clear()
        changed = self.addresses.write(wanted)
        self.holds.release_gone(self._pod)
        changed |= self.addresses.publish_status(pending_pods=len(self._pending),
                                                 synced=self.synced)
        changed |= self.addresses.publish_dates(verified_ns=rt.verified_ns,
                                                failed_ns=rt.failed_ns, stale=rt.stale,
                                                have_view=rt.owners is not None)
        changed |= self.addresses.publish_mode(self.runtime_mode)
        self.counts["commits"] += 1
        if changed:
            self.notify()
        return changed

    def _wanted(self, ip: str, owner: Owner) -> Written | None:
        if owner is KEEP:
            return self.addresses.written.get(ip)
        if owner is None:
            return None
        if isinstance(owner, Undecided):
            return (owner.uid, POD_UNDECIDED, -1)
        assert isinstance(owner, str)
        # A proven owner the model no longer knows (deleted from the API while the runtime
        # could not be asked): its address waits, it is not free.
        return self._entry(owner) or (owner, POD_UNDECIDED, -1)

    def _entry(self, uid: str) -> Written | None:
        """The table entry of an address ``uid`` owns."""
        pod = self._pod(uid)
        if pod is None:
            return None
        ident = pod.identity
        if ident is None:
            return (uid, POD_UNDECIDED, -1)   # known owner, policy still open: workers wait
        if ident.kind == IdentityKind.ROLE:
            # Its credentials are served by token only (the slot stays the pod's).
            return (uid, POD_DENIED if pod.token_only else POD_ROLE, pod.cred_slot)
        if ident.kind == IdentityKind.NO_ROLE:
            return (uid, POD_NO_ROLE, -1)
        return (uid, POD_DENIED, -1)

    # ---- internals ----------------------------------------------------------------------------

    def _pod(self, uid: str) -> PodRecord | None:
        return self.pods.get(uid) or self.sandbox_pods.get(uid)

    def _ips_of(self, pod: PodRecord) -> Iterable[str]:
        """The addresses this pod owns under the current source of ownership."""
        rt = self.runtime
        if rt.owners is not None:
            if rt.stale:
                return set(rt.ips.get(pod.uid, ())) | set(pod.claims)
            return rt.ips.get(pod.uid, ())
        return pod.claims

    def _address(self, pod: PodRecord) -> str | None:
        """The pod's first address (its decision's, and what its session is named by)."""
        ips = sorted(self._ips_of(pod)) or ([] if pod.host_network else sorted(pod.api_ips))
        return ips[0] if ips else None

    def _remove(self, uid: str, *, removed_rv: int) -> None:
        """The pod left the API at ``removed_rv`` (its delete's resourceVersion, or the list's
        that no longer shows it).  Nothing is kept per removed pod: a late copy of it can only
        be older than ``removed_rv`` (a delete is written after every version of the pod), and
        no pod the model has not seen can be, since the watch hands over objects in the order
        of their writes and a list holds every pod written before it.  So ``apply_pod`` turns
        away an unknown pod older than the newest removal (docs/architecture.md, "Nothing
        kept per pod")."""
        pod = self.pods.pop(uid, None)
        if not removed_rv and pod is not None and pod.rv:
            removed_rv = pod.rv + 1          # a delete without a version: after the last seen
        self._removed_before = max(self._removed_before, removed_rv)
        if pod is None:
            return
        members = self._by_ns.get(pod.namespace)
        if members is not None:
            members.discard(uid)
            if not members:
                del self._by_ns[pod.namespace]
        self._dirty_ips |= self.api.drop_all(pod)
        self._pending.discard(uid)
        self.holds.forget(pod)
        self._dirty_pods.discard(uid)
        if uid in self.runtime.sandboxes and not self.runtime.stale:
            # Deleted from the API while its sandbox still runs (a forced delete): the
            # processes asking from its address are still this pod's.  Not from a stale
            # view: the API's delete is the fresher evidence.
            if self.sandbox_pods.show(self.runtime.sandboxes[uid]):
                self._dirty_pods.add(uid)

    def _refresh_pending(self, pod: PodRecord) -> None:
        if pod.from_api and pod.live and (not pod.api_ips or pod.identity is None):
            self._pending.add(pod.uid)
        else:
            self._pending.discard(pod.uid)

    def _decide(self, pod: PodRecord) -> None:
        if not pod.decided:
            # Terminal (or hostNetwork, unless by token): no addresses, no credentials.
            self.holds.drop(pod)
            pod.identity = PodIdentity.denied("not running")
            pod.undecided_since = None
            self._dirty_ips.update(self._ips_of(pod))
            self._refresh_pending(pod)
            return
        self.holds.keep(pod.uid)
        ident, pod.source = self.decider.decide(pod, self.namespaces.get(pod.namespace))
        if ident is not None and ident.kind == IdentityKind.ROLE:
            if not self.holds.acquire(pod, ident, address=self._address(pod)):
                self.counts["acquire_errors"] += 1
                ident = None               # no slot: it waits and is retried
        else:
            self.holds.drop(pod)           # released after the table stops naming the slot
        pod.identity = ident
        self._dirty_ips.update(self._ips_of(pod))
        self._refresh_pending(pod)
