"""The one rule that merges the sources: who owns an address now.

* A runtime is asked (its last view, fresh or stale): the pod of the view's sandbox whose
  network namespace the kernel shows holding the address, and in no other namespace, owns
  it (``RuntimeOwners``); nobody else, whatever the API says.  An address something else
  claims (a READY sandbox the kernel does not show on it, the API's pod, what a previous
  process wrote) while nothing proves an owner is *undecided*: workers wait, then answer
  503 (the SDK retries), never another pod's role.  Where nothing claims it, it is free
  (404).  While the runtime cannot be asked the same holds with its last view: the kernel,
  not the age of the view, says whether the sandbox behind the address is still the one the
  view showed (a stale source may only take an owner away: the kernel is read now).
* No runtime: the API's order of writes (``api_owners``).
* Before the first answer of an expected runtime, and after a restart before the node is
  known (first sync or view), what the table holds is kept: workers do not answer it
  anyway until a poll newer than their connection (runtime mode) or a sync (API mode).
"""
from __future__ import annotations

from dataclasses import dataclass

from kiamfast.control.mappings.runtime_owners import RuntimeOwners


class Keep:
    """Keep what the table holds for the address."""


KEEP = Keep()


@dataclass(frozen=True, slots=True)
class Undecided:
    """An address claimed but not proven (or an owner the policy cannot serve yet): workers
    wait."""
    uid: str


Owner = str | Undecided | Keep | None


class Merge:
    def __init__(self, *, runtime: RuntimeOwners) -> None:
        self.runtime = runtime
        self.reconciled = True           # False after a restart until the node is known

    def owner(self, ip: str, api_owner: str | None) -> Owner:
        """``KEEP``, None (free), an :class:`Undecided`, or the owning pod's uid."""
        rt = self.runtime
        if rt.awaiting:
            return KEEP                 # the runtime decides, once it answers
        if rt.owners is None:
            uid = api_owner
        else:
            uid = rt.owners.get(ip)
            if uid is None:
                claimant = rt.claims.get(ip) or api_owner
                if claimant is not None:
                    return Undecided(claimant)
        if uid is None:
            return None if self.reconciled else KEEP   # a restart: keep until we know
        return uid
