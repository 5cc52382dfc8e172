"""Address ownership by the container runtime, proven by the kernel, and how fresh that is.

The runtime says which sandboxes are READY, which pod each one is (the kubelet's labels) and
where its network namespace is; the kernel says which namespace holds an address now
(`kiamfast.control.netns.watch`).  An address belongs to the pod of a sandbox of the last
view only while the kernel shows it configured in that sandbox's namespace and in no other.
The runtime's own word ("READY on X") is never the proof: CRI-O frees a stopping sandbox's
address while it is still READY (docs/architecture.md, "Who owns an address").  An address
the runtime says a sandbox holds but the kernel does not show there is *claimed*: nobody is
answered on it until the proof comes.  Each applied view is dated by when its poll began, so
workers answer a connection only from a view begun after the connection was accepted, with
the kernel read after that view (docs/architecture.md, "Freshness").

Without a kernel witness (``--address-proof=runtime``: the demo, pods on loopback addresses
with no namespace of their own) a READY sandbox is taken to hold its addresses, which holds
for containerd's order of a stop only; and while the runtime cannot be asked, nothing is
proven, so every address the last view showed waits.

States: *none* (no runtime: the API's order of writes decides), *awaiting* (a runtime is
expected but has not answered: nothing is decided meanwhile, workers wait for its first
poll), *fresh* (the last poll succeeded) and *stale* (the last attempt failed: the last
view's sandboxes stand, with the kernel's word as it is now).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from kiamfast.control.mappings.canonical import canonical_ip

log = logging.getLogger("kiamfast.ownership")


class SandboxLike(Protocol):
    """What the model reads of a `kiamfast.control.cri.client.Sandbox`."""
    id: str
    pod_uid: str
    name: str
    namespace: str
    ips: tuple[str, ...]
    netns: str
    annotations: Mapping[str, str]


class RuntimeViewLike(Protocol):
    """What the model reads of a `kiamfast.control.cri.client.RuntimeView`."""
    started_ns: int
    sandboxes: tuple[SandboxLike, ...]


class AddressProof(Protocol):
    """The kernel's word (`kiamfast.control.netns.watch.NetnsWatch`)."""

    def addresses_of(self, sandbox: SandboxLike) -> frozenset[str] | None:
        """The addresses configured in the sandbox's network namespace now and in no other
        namespace; None if its namespace is not known."""


class RuntimeOwners:
    def __init__(self, *, expected: bool, proof: AddressProof | None = None) -> None:
        self.proof = proof
        self.owners: dict[str, str] | None = None    # ip -> uid, proven; None: no view yet
        self.ips: dict[str, set[str]] = {}           # uid -> its proven ips
        self.claims: dict[str, str] = {}             # ip -> uid claiming it, unproven
        self.sandboxes: dict[str, SandboxLike] = {}  # uid -> its READY sandbox (last view)
        self.expected = expected                     # runtime_mode: workers need a poll
        self.awaiting = expected                     # expected, not answered yet
        self.stale = False                           # the last attempt failed
        self.verified_ns = 0                         # date of the view now applied
        self.failed_ns = 0                           # date of the last failed attempt
        self._view: tuple[SandboxLike, ...] = ()     # the last view's sandboxes
        self._adopted: dict[str, str] = {}           # a previous process's owners (claims)

    @property
    def fresh(self) -> bool:
        return self.owners is not None and not self.stale

    def owner(self, ip: str) -> str | None:
        return self.owners.get(ip) if self.owners is not None else None

    def unchanged(self, view: RuntimeViewLike) -> bool:
        """The same READY set as the last applied poll (the client hands back the same
        objects): only the view's date moves on."""
        if view.sandboxes is self._view and self.fresh:
            self.verified_ns = max(self.verified_ns, view.started_ns)
            return True
        return False

    def apply(self, view: RuntimeViewLike) -> tuple[set[str], bool]:
        """A successful poll: (the addresses that may have changed hands, whether this ends
        a time of no or stale evidence, when every address may have)."""
        everything = self.owners is None or self.stale or self.awaiting
        if everything:
            log.info("addresses now follow the container runtime (%d sandboxes)",
                     len(view.sandboxes))
        self._view = view.sandboxes
        self._adopted = {}
        self.sandboxes = {s.pod_uid: s for s in view.sandboxes if s.pod_uid}
        self.expected, self.awaiting, self.stale = True, False, False
        self.verified_ns = max(self.verified_ns, view.started_ns)
        return self.prove(), everything

    def fail(self, started_ns: int, adopted: Mapping[str, str]) -> bool:
        """A poll attempt begun at ``started_ns`` failed; True when this begins a stale
        episode.  Without a view of this process yet, a previous process's owners
        (``adopted``: ip -> uid) are claims: they wait, since nothing proves them."""
        self.failed_ns = max(self.failed_ns, started_ns)
        if self.stale:
            return False
        if self.proof is not None:
            log.warning("the container runtime cannot be asked: an address keeps its owner "
                        "only while the kernel shows it in that pod's sandbox's network "
                        "namespace")
        else:
            log.warning("the container runtime cannot be asked: no address is answered with "
                        "a role until it answers (--address-proof=runtime proves nothing "
                        "meanwhile)")
        self.expected, self.stale, self.awaiting = True, True, False
        if self.owners is None:
            self.owners = {}
            self._adopted = dict(adopted)
        self.prove()
        return True

    def prove(self) -> set[str]:
        """Decide every address again from the last view and what the kernel shows now;
        returns the addresses whose owner or claim changed."""
        owners: dict[str, str] = {}
        claims: dict[str, str] = dict(self._adopted)
        shared: set[str] = set()      # held by two sandboxes: nobody's
        for sandbox in self._view:
            uid = sandbox.pod_uid
            if not uid:
                continue
            held = self._held(sandbox)
            for ip in held:
                if ip in shared:
                    continue
                if owners.setdefault(ip, uid) != uid:
                    claims[ip] = owners.pop(ip)
                    shared.add(ip)
            for ip in sandbox.ips:
                c = canonical_ip(ip)
                if c is not None and c not in held:
                    claims.setdefault(c, uid)
        for ip in owners:
            claims.pop(ip, None)
        before_owners, before_claims = self.owners or {}, self.claims
        dirty = {ip for ip in owners.keys() | before_owners.keys()
                 if owners.get(ip) != before_owners.get(ip)}
        dirty |= {ip for ip in claims.keys() | before_claims.keys()
                  if claims.get(ip) != before_claims.get(ip)}
        by_uid: dict[str, set[str]] = {}
        for ip, uid in owners.items():
            by_uid.setdefault(uid, set()).add(ip)
        self.owners, self.ips, self.claims = owners, by_uid, claims
        return dirty

    def _held(self, sandbox: SandboxLike) -> frozenset[str]:
        """The addresses the sandbox is proven to hold now."""
        if self.proof is not None:
            return self.proof.addresses_of(sandbox) or frozenset()
        if self.stale:
            return frozenset()         # no kernel: a stale view proves nothing
        return frozenset(c for c in map(canonical_ip, sandbox.ips) if c is not None)
