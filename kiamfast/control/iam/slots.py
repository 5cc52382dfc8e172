"""A credential key's record, and the table's credential slots the keys live in.

Every key the manager knows (:class:`KeyEntry`) owns one credential slot of the table, where
workers find its rendered credentials.  :class:`SlotPool` keeps which key holds which slot
and which slots are free (lowest first, so a small node uses the start of the table).

A slot is never freed, and so never reused for another key, while an address in the table
names it: the table's writer counts those addresses (``slot_refs``), and a worker reading a
reused slot would serve one pod another key's credentials.  When every slot is taken, the
idle key (no pod left, within its grace period) used least recently gives its slot up.

After a restart (:meth:`SlotPool.adopt`) every slot still carries its key and expiry
(``credential_parts.PART_KEY``): servable ones become entries of their key again, every other slot
that holds anything is kept out of allocation until no address names it (:meth:`reclaim`).
"""
from __future__ import annotations

import datetime as _dt
import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiamfast import credential_parts
from kiamfast.control.iam.keys import CredentialKey, CredentialRequest
from kiamfast.control.iam.schedule import PRIO_NEW
from kiamfast.control.iam.sts import Credentials, StsError
from kiamfast.table import CRED_EMPTY, CRED_READY

# A key's state, as the manager sees it (the table's CRED_* states are what workers see).
PENDING, READY, ERROR, DENIED = "pending", "ready", "error", "denied"
STATES = (PENDING, READY, ERROR, DENIED)


class CredentialSlotsExhausted(Exception):
    """Every credential slot of the table is used by a live key."""


class CredentialTable(Protocol):
    def write_cred(self, slot: int, parts: list[bytes], *, serve_until: float,
                   state: int) -> None: ...
    def set_cred_state(self, slot: int, state: int, serve_until: float | None = None) -> None: ...
    def clear_cred(self, slot: int) -> None: ...


class SlotRefs(Protocol):
    """How many addresses in the table name a credential slot (the table's writer counts)."""

    def __getitem__(self, slot: int) -> int: ...


class NoRefs(dict):
    def __missing__(self, slot: int) -> int:
        return 0


@dataclass(eq=False)
class KeyEntry:
    """One credential key: its slot, the pods using it, its credentials and its next call."""

    key: CredentialKey
    slot: int
    users: dict[str, CredentialRequest] = field(default_factory=dict)  # pod UID -> request
    state: str = PENDING
    creds: Credentials | None = None
    serve_until: float = 0.0
    fetched_at: float = 0.0
    refresh_at: float = 0.0
    failures: int = 0              # consecutive failed attempts
    denials: int = 0               # consecutive permanent refusals
    not_before: float = 0.0        # backoff: no attempt before this (except refresh-ahead)
    last_error: StsError | None = None
    inflight: bool = False
    queued: tuple | None = None    # (priority, deadline) it is queued with, None if not queued
    timer: int = 0                 # version of the one live timer; older timers are ignored
    timer_prio: int = PRIO_NEW     # queue priority when a "fetch" timer fires
    idle_since: float | None = None
    waiting: bool = False          # a pod asked and it was not servable: PRIO_WANTED until it is
    asked_at: float = 0.0          # when it started waiting
    due: float = float("inf")      # when its first pod could ask: the earliest acquisition ...
    addressed: bool = False        # ... of a pod with an address, if any has one
    freed: bool = False
    issued: int = 0                # credentials issued for this key so far
    quick_retry: bool = False      # a pod's request is held: a throttled call retries once soon
    unsendable: bool = False       # a tag value STS cannot take: denied, never fetched

    def describe(self) -> dict[str, Any]:
        """Debug view (no secrets)."""
        return {"role_arn": self.key.role_arn, "external_id": bool(self.key.external_id),
                "session": self.key.session, "tags": dict(self.key.tags), "state": self.state,
                "access_key_id": self.creds.access_key_id if self.creds else None,
                "serve_until": self.serve_until, "refresh_at": self.refresh_at,
                "failures": self.failures, "users": sorted(self.users),
                "last_error": self.last_error.code if self.last_error else None}


class SlotPool:
    """Which key holds which credential slot, and which slots are free or held."""

    def __init__(self, *, table: CredentialTable, capacity: int, slot_refs: SlotRefs) -> None:
        self.table = table
        self.capacity = capacity
        self.slot_refs = slot_refs
        self.by_key: dict[CredentialKey, KeyEntry] = {}
        self.by_slot: dict[int, KeyEntry] = {}
        self._free = list(range(capacity))          # a heap: lowest slot first
        self._held: set[int] = set()                # adopted slots not reused yet: see adopt()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def held(self) -> int:
        return len(self._held)

    def named(self, slot: int) -> bool:
        """An address in the table names this slot: it must not go to another key."""
        return bool(self.slot_refs[slot])

    def has_role(self, role_arn: str) -> bool:
        return any(k.role_arn == role_arn for k in self.by_key)

    def allocate(self, key: CredentialKey, *, evict: Callable[[KeyEntry], None]) -> KeyEntry:
        """A new entry for ``key`` in the lowest free slot.  With none free, ``evict`` is
        asked to free the idle key that has been idle longest and no address names.
        Raises CredentialSlotsExhausted when every slot is in use by a live key."""
        if not self._free:
            idle = [e for e in self.by_key.values()
                    if e.idle_since is not None and not self.named(e.slot)]
            if not idle:
                raise CredentialSlotsExhausted(
                    f"all {self.capacity} credential slots are used by live keys")
            evict(min(idle, key=lambda e: e.idle_since))
        entry = KeyEntry(key=key, slot=heapq.heappop(self._free))
        self.by_key[key] = entry
        self.by_slot[entry.slot] = entry
        return entry

    def remove(self, entry: KeyEntry) -> None:
        """The key is gone: its slot is cleared and free for another."""
        self.by_key.pop(entry.key, None)
        self.by_slot.pop(entry.slot, None)
        self.table.clear_cred(entry.slot)
        heapq.heappush(self._free, entry.slot)

    def adopt(self, slots: Iterable[tuple[int, int, float, list[bytes]]], *, now: float,
              refresh_time: Callable[[float, float, float], float]) -> list[KeyEntry]:
        """Take over what a previous control process left in the table, as ``(slot, state,
        serve_until, parts)`` for every slot.  Servable credentials and error documents
        become entries of their key, idle since ``now`` (credentials are refreshed at
        ``refresh_time(fetched_at, expires, serve_until)``); every other slot that holds
        anything is held until no address names it.  Returns the new entries."""
        adopted = []
        for slot, state, serve_until, parts in slots:
            if not 0 <= slot < self.capacity or slot in self.by_slot:
                continue
            record = credential_parts.parse_key_part(parts)
            if state == CRED_EMPTY and record is None:
                continue
            self._free = [s for s in self._free if s != slot]
            key = None if record is None else CredentialKey(
                record["role_arn"], record["external_id"], record["session"],
                tuple(tuple(t) for t in record["tags"]))
            if (key is None or key in self.by_key or state != CRED_READY
                    or serve_until <= now):
                self._held.add(slot)
                continue
            entry = KeyEntry(key=key, slot=slot, serve_until=serve_until,
                             fetched_at=record["fetched_at"], idle_since=now)
            if record["denied"]:
                entry.state = DENIED
            else:
                entry.state = READY
                entry.creds = Credentials(
                    access_key_id=record["access_key_id"], secret_access_key="",
                    session_token="", expiration=_dt.datetime.fromtimestamp(
                        record["expiration"], _dt.timezone.utc))
                entry.refresh_at = refresh_time(record["fetched_at"], record["expiration"],
                                                serve_until)
            self.by_key[key] = entry
            self.by_slot[slot] = entry
            adopted.append(entry)
        heapq.heapify(self._free)
        return adopted

    def reclaim(self) -> None:
        """Free the held slots that no address names any more (call after commits)."""
        for slot in sorted(self._held):
            if not self.named(slot):
                self._held.discard(slot)
                self.table.clear_cred(slot)
                heapq.heappush(self._free, slot)
