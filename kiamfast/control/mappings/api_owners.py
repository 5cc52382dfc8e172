"""Address ownership by the API server's order of writes (used where no runtime decides).

* A pod owns its addresses (``status.podIPs``, falling back to ``status.podIP``) while its
  phase is Pending, Running or Unknown and it is not hostNetwork.  A terminal phase or the
  delete releases them at once; a terminating pod (deletionTimestamp) keeps them until then.
* Two pods can claim one address: the API still shows a dead pod Running after its address
  went to a new pod.  Each (pod, address) claim is keyed by the resourceVersion that first
  showed it (the watch event's, or the list's), then creationTimestamp, non-terminating over
  terminating, UID; the highest key owns the address.  An address is written to a pod's
  status only after its previous owner gave it up, so a claim seen later is newer.  A claim
  keeps its first key: a late event of an old pod never makes it newer.
* High-water mark: an address remembers the highest key that ever owned it while any pod
  still claims it, so when the new owner goes away the address becomes free, never the
  stale old pod's again.

Kept up to date even while the runtime decides: the fallback needs the API's owner the
moment a runtime poll fails.  This mode has the API's limits: an address reused while the
API still shows the previous pod Running is that pod's until the API publishes the change.
"""
from __future__ import annotations

from collections.abc import Mapping

from kiamfast.control.mappings.decider import ClaimKey, PodRecord


class ApiOwners:
    def __init__(self) -> None:
        self.claimants: dict[str, set[str]] = {}     # ip -> uids of the pods claiming it
        self._hw: dict[str, ClaimKey] = {}
        self.displaced = 0                           # owners a newer claim took over from

    def set_claims(self, pod: PodRecord, *, seen: int) -> set[str]:
        """Make the pod's claims match its published addresses (new claims keyed at
        ``seen``); returns the addresses whose claims changed."""
        dirty: set[str] = set()
        wanted = set(pod.api_ips) if pod.live else set()
        for ip in list(pod.claims):
            if ip not in wanted:
                dirty |= self.drop(pod, ip)
        rank = 0 if pod.terminating else 1
        for ip in wanted:
            if ip not in pod.claims:
                pod.claims[ip] = (seen, pod.created, rank, pod.uid)
                self.claimants.setdefault(ip, set()).add(pod.uid)
                dirty.add(ip)
        return dirty

    def drop(self, pod: PodRecord, ip: str) -> set[str]:
        del pod.claims[ip]
        members = self.claimants.get(ip)
        if members is not None:
            members.discard(pod.uid)
            if not members:
                del self.claimants[ip]
                self._hw.pop(ip, None)
        return {ip}

    def drop_all(self, pod: PodRecord) -> set[str]:
        dirty: set[str] = set()
        for ip in list(pod.claims):
            dirty |= self.drop(pod, ip)
        return dirty

    def owner(self, ip: str, pods: Mapping[str, PodRecord]) -> str | None:
        """The pod whose claim on ``ip`` is newest, unless an older one than a previous
        owner's (the high-water mark); records the mark."""
        members = self.claimants.get(ip)
        if not members:
            return None
        best_key: ClaimKey | None = None
        best = None
        for uid in members:
            k = pods[uid].claims[ip]
            if best_key is None or k > best_key:
                best_key, best = k, uid
        assert best_key is not None
        hw = self._hw.get(ip)
        if hw is not None and best_key < hw:
            return None   # every remaining claim is older than one that already won
        if hw is not None and best_key > hw:
            self.displaced += 1
        self._hw[ip] = best_key
        return best
