"""Address ownership by the container runtime, and how fresh that is.

Where the runtime answers, an address belongs to the pod of the one READY sandbox that holds
it, and to nobody else, whatever the API server says (CNI gives a sandbox its address before
any container starts; a stopped sandbox holds none; the API learns both seconds later).  Each
applied view is dated by when its poll began, so workers answer a connection only from a
view begun after the connection was accepted (docs/architecture.md, "Freshness").

States: *none* (no runtime: the API's order of writes decides), *awaiting* (a runtime is
expected but has not answered: nothing is decided meanwhile, workers wait for its first
poll), *fresh* (the last poll succeeded) and *stale* (the last attempt failed: the merge's
fallback decides from this last view, which may only take owners away).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from kiamfast.control.mappings.addresses import canonical_ip

log = logging.getLogger("kiamfast.ownership")


class SandboxLike(Protocol):
    """What the model reads of a `kiamfast.control.cri.poller.Sandbox`."""
    pod_uid: str
    name: str
    namespace: str
    ips: tuple[str, ...]
    annotations: Mapping[str, str]


class RuntimeViewLike(Protocol):
    """What the model reads of a `kiamfast.control.cri.poller.RuntimeView`."""
    started_ns: int
    owners: Mapping[str, SandboxLike]


class RuntimeOwners:
    def __init__(self, *, expected: bool) -> None:
        self.owners: dict[str, str] | None = None    # ip -> uid of the last view; None: none
        self.ips: dict[str, set[str]] = {}           # uid -> ips, the same view inverted
        self.sandboxes: dict[str, Any] = {}          # uid -> its READY sandbox
        self.expected = expected                     # runtime_mode: workers need a poll
        self.awaiting = expected                     # expected, not answered yet
        self.stale = False                           # the last attempt failed
        self.verified_ns = 0                         # date of the view now applied
        self.failed_ns = 0                           # date of the last failed attempt
        self._last_owners: object = None             # the last view's owners, as handed over

    @property
    def fresh(self) -> bool:
        return self.owners is not None and not self.stale

    def owner(self, ip: str) -> str | None:
        return self.owners.get(ip) if self.owners is not None else None

    def unchanged(self, view: RuntimeViewLike) -> bool:
        """The same READY set as the last applied poll (the client hands back the same
        objects): only the view's date moves on."""
        if view.owners is self._last_owners and self.fresh:
            self.verified_ns = max(self.verified_ns, view.started_ns)
            return True
        return False

    def apply(self, view: RuntimeViewLike) -> tuple[set[str], bool]:
        """A successful poll: (the addresses that may have changed hands, whether this ends
        a time of no or stale evidence, when every address may have)."""
        self._last_owners = view.owners
        owners: dict[str, str] = {}
        by_uid: dict[str, set[str]] = {}
        sandboxes: dict[str, Any] = {}
        for ip, sandbox in view.owners.items():
            c = canonical_ip(ip)
            if c is None or not sandbox.pod_uid:
                continue
            owners[c] = sandbox.pod_uid
            by_uid.setdefault(sandbox.pod_uid, set()).add(c)
            sandboxes[sandbox.pod_uid] = sandbox
        if self.owners is None or self.stale or self.awaiting:
            log.info("addresses now follow the container runtime (%d sandboxes)", len(by_uid))
            dirty = set(owners) | set(self.owners or ())
            everything = True
        else:
            dirty = {ip for ip in owners.keys() | self.owners.keys()
                     if owners.get(ip) != self.owners.get(ip)}
            everything = False
        self.owners, self.ips, self.sandboxes = owners, by_uid, sandboxes
        self.expected, self.awaiting, self.stale = True, False, False
        self.verified_ns = max(self.verified_ns, view.started_ns)
        return dirty, everything

    def fail(self, started_ns: int, written: Mapping[str, tuple[str, int, int]]) -> bool:
        """A poll attempt begun at ``started_ns`` failed; True when this begins a stale
        episode.  Without a view of this process yet, what the table holds (a previous
        process's decisions) stands in for the last view, with the same limits."""
        self.failed_ns = max(self.failed_ns, started_ns)
        if self.stale:
            return False
        log.warning("the container runtime cannot be asked: an address keeps its owner only "
                    "where the runtime's last view and the API server name the same pod")
        self.expected, self.stale, self.awaiting = True, True, False
        if self.owners is None:
            self.owners = {ip: uid for ip, (uid, _, _) in written.items()}
            for ip, uid in self.owners.items():
                self.ips.setdefault(uid, set()).add(ip)
        return True
