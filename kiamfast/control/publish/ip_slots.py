"""The table's address entries and status words, as the control process writes them.

``written`` mirrors the IP slots exactly (at start: whatever a previous control process left
there), and ``refs`` counts how many addresses name each credential slot: the credential
manager never frees, and so never reuses for another key, a slot an address still names.
Claims are written before releases (a moved address is one write); the runtime view's date
is published after the slots it covers, so a worker never trusts a slot older than the poll
it compares its connection against.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

log = logging.getLogger("kiamfast.ownership")

Written = tuple[str, int, int]          # (pod uid, pod state, credential slot)


class TableWriter(Protocol):
    """The writer half of `kiamfast.table.Table` used here."""

    def claim_ip(self, ip: str, pod_uid: str, pod_state: int, cred_slot: int = -1) -> None: ...
    def release_ip(self, ip: str, pod_uid: str) -> bool: ...
    def set_status(self, *, synced: bool | None = None, ready: bool | None = None,
                   pending_pods: int | None = None,
                   runtime_mode: bool | None = None) -> None: ...
    def set_verified(self, started_ns: int) -> None: ...
    def set_failed(self, started_ns: int) -> None: ...


class AddressTable:
    def __init__(self, table: TableWriter, *, adopted: Mapping[str, Written],
                 refs: Counter | None = None) -> None:
        self.table = table
        self.refs: Counter = refs if refs is not None else Counter()
        self.written: dict[str, Written] = {}
        for ip, entry in adopted.items():
            self._set(ip, entry)
        self.counters = {"claims": 0, "releases": 0, "table_full": 0}
        self._status: tuple[int, bool] | None = None
        self._verified = 0
        self._failed = 0
        self._mode: bool | None = None

    def _set(self, ip: str, entry: Written) -> None:
        old = self.written.get(ip)
        if old is not None:
            self.refs[old[2]] -= 1
        self.written[ip] = entry
        self.refs[entry[2]] += 1

    def _drop(self, ip: str) -> Written | None:
        old = self.written.pop(ip, None)
        if old is not None:
            self.refs[old[2]] -= 1
        return old

    def write(self, wanted: Mapping[str, Written | None]) -> bool:
        """Make the table's entries for these addresses what ``wanted`` says (None: free);
        claims first, then releases.  Returns whether anything changed."""
        changed = False
        releases = []
        for ip in sorted(wanted):
            want, have = wanted[ip], self.written.get(ip)
            if want == have:
                continue
            if want is None:
                releases.append(ip)
                continue
            uid, state, slot = want
            try:
                self.table.claim_ip(ip, uid, state, slot)
            except Exception as e:   # TableFull: the pod stays unknown to workers (MISS)
                self.counters["table_full"] += 1
                log.error("cannot write %s -> %s: %s", ip, uid, e)
                old = self._drop(ip)
                if old is not None:
                    self.table.release_ip(ip, old[0])
                continue
            self._set(ip, want)
            self.counters["claims"] += 1
            changed = True
        for ip in releases:
            old = self._drop(ip)
            if old is not None:
                self.table.release_ip(ip, old[0])
                self.counters["releases"] += 1
                changed = True
        return changed

    def publish_status(self, *, pending_pods: int, synced: bool) -> bool:
        status = (pending_pods, synced)
        if status == self._status:
            return False
        self.table.set_status(pending_pods=pending_pods, synced=synced)
        self._status = status
        return True

    def publish_dates(self, *, verified_ns: int, failed_ns: int, stale: bool,
                      have_view: bool) -> bool:
        """The view's date last: workers trust the slots above for connections older than
        it; after a failed attempt, the date of that attempt (the slots follow the
        fallback)."""
        if stale:
            if failed_ns > self._failed:
                self.table.set_failed(failed_ns)
                self._failed = failed_ns
                return True
        elif have_view and verified_ns > self._verified:
            self.table.set_verified(verified_ns)
            self._verified = verified_ns
            return True
        return False

    def publish_mode(self, runtime_mode: bool) -> bool:
        if runtime_mode == self._mode:
            return False
        self.table.set_status(runtime_mode=runtime_mode)
        self._mode = runtime_mode
        return True

    def uids(self) -> set[str]:
        return {uid for uid, _, _ in self.written.values()}

    def snapshot(self) -> dict[str, Any]:
        return dict(self.written)
