"""The one rule that merges the two sources: who owns an address now.

* The runtime answers (fresh view): the pod of the READY sandbox holding the address owns
  it; nobody else, whatever the API says.
* No runtime: the API's order of writes (``api_owners``).
* The runtime cannot be asked (stale view): **a stale source may only remove an owner.**
  The agent's link to the runtime can break while the kubelet goes on stopping and starting
  sandboxes, so the last view is old evidence.  An address keeps an owner only where the
  last view and the API name the same pod, and only while nothing says the sandbox behind it
  may have changed (:meth:`Merge.agreement_holds`).  Otherwise nobody owns it: it is
  *undecided* (workers wait, then answer 503: the SDK retries) until a poll succeeds.  Where
  neither names a pod, it is free (404).
* Before the first answer of an expected runtime, and after a restart before the node is
  known (first sync or view), what the table holds is kept: workers do not answer it
  anyway until a poll newer than their connection (runtime mode) or a sync (API mode).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kiamfast.control.mappings.runtime_owners import RuntimeOwners


class HostRoutesLike(Protocol):
    """The kernel's second witness while the runtime cannot be asked
    (`kiamfast.control.cri.routes.RouteWatch`)."""
    generation: int   # bumped whenever an answer of path_kept may have changed

    def path_kept(self, ip: str, since_ns: int) -> bool | None:
        """True: replies to `ip` have gone down one pod veth ever since `since_ns`; False:
        its host route or link changed since; None: no evidence either way."""


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


KEEP = object()   # keep what the table holds for the address


@dataclass(frozen=True, slots=True)
class Undecided:
    """A known owner the sources disagree on (or cannot vouch for): workers wait."""
    uid: str


class Merge:
    def __init__(self, *, runtime: RuntimeOwners, routes: HostRoutesLike | None) -> None:
        self.runtime = runtime
        self.evidence = RouteEvidence(routes)
        self.newcomer_unplaced = False   # the strict guard, as last applied
        self.reconciled = True           # False after a restart until the node is known

    def owner(self, ip: str, api_owner: str | None) -> object:
        """``KEEP``, None (free), an :class:`Undecided`, or the owning pod's uid."""
        rt = self.runtime
        if rt.awaiting:
            return KEEP                 # the runtime decides, once it answers
        if rt.owners is None:
            uid = api_owner
        elif rt.stale:
            return self._fallback(ip, api_owner)
        else:
            uid = rt.owner(ip)
        if uid is None:
            return None if self.reconciled else KEEP   # a restart: keep until we know
        return uid

    def _fallback(self, ip: str, api_owner: str | None) -> object:
        seen = self.runtime.owner(ip)
        if seen is None and api_owner is None:
            return None
        if seen == api_owner and self.agreement_holds(ip):
            return seen
        return Undecided(api_owner or seen)   # type: ignore[arg-type]

    def agreement_holds(self, ip: str) -> bool:
        """Does an address the last view and the API agree on keep its owner?

        The host's route to it decides where it has one (`RouteEvidence`): unchanged since
        the last view began, the replies still go to that view's sandbox, whoever else
        started meanwhile; changed, the sandbox may have changed.  Without that evidence
        (bridge CNIs, policy routing that may divert replies) the strict rule: only while
        no pod of the node could hold an address unseen by both (a pod the last view did
        not show, whose address the API has not published: it may sit on an address a dead
        pod freed while the API still shows the dead one).  That pod's own requests wait
        either way (pending_pods)."""
        kept = self.evidence.kept(ip)
        if kept is not None:
            return kept
        return not self.newcomer_unplaced
