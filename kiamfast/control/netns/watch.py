"""Which network namespace holds each address, from the node's kernel: the proof that a
sandbox holds an address *now*, whatever its runtime says or in what order it works.

The runtime says which pod a sandbox is (the kubelet's labels) and where its network
namespace is (the path in its verbose status), but "READY on X" is no proof that the sandbox
holds X: CRI-O tears a sandbox's network down (CNI DEL: the address goes back to IPAM) before
it stops its containers and only then leaves READY, so for a while a READY sandbox claims an
address the next sandbox may already hold (docs/architecture.md, "Who owns an address").
The kernel is the witness every runtime shares: an address configured in one network
namespace and in no other is where the agent's reply to it goes, so only processes of that
namespace can read it, and a namespace belongs to one sandbox for its whole life.

`NetnsWatch` keeps, for this namespace and every namespace that has an nsid here, the
addresses configured in it, current through the kernel's notifications:

* one rtnetlink socket subscribed to the address and nsid groups with
  NETLINK_LISTEN_ALL_NSID (CAP_NET_BROADCAST): every address change of every namespace with
  an nsid here arrives tagged with that nsid (the agent's own namespace: no tag), and
  RTM_NEWNSID / RTM_DELNSID say when a namespace got an nsid or went away (the kernel
  forgets a dead namespace's nsid before it tears its devices down, so nothing of it
  arrives afterwards, and may give the nsid to the next namespace: a sandbox's reference to
  an nsid is dropped at its RTM_DELNSID and made again from its path);
* the addresses of a namespace come from a dump (RTM_GETADDR with IFA_TARGET_NETNSID,
  CAP_NET_ADMIN, Linux >= 4.20) when its nsid first shows, then from notifications;
* a sandbox's namespace is found from its path: opened (the namespace cannot go away while
  it is open), checked to be a network namespace that is not the agent's own, and its nsid
  asked for (RTM_GETNSID by file descriptor), assigned first if it has none (RTM_NEWNSID:
  then its notifications reach the socket); its addresses are dumped before the descriptor
  is closed, so they are that namespace's;
* a socket overrun (ENOBUFS: notifications lost) forgets everything and reads it again.

`addresses_of(sandbox)` is the answer the ownership model uses: the addresses configured in
the sandbox's namespace now and in no other namespace the watch sees (the agent's own
included), loopback and IPv6 link-local addresses left out; None when the sandbox's
namespace is not known (no path, a path that does not open, no nsid).  Changes reach the
model as they are read (`drain` from the event loop, `refresh` before each decision), each
batch bumping `generation`.

It reads the agent's own network namespace and the namespaces of the sandboxes it is given;
the only state it changes is an nsid for a sandbox's namespace that had none.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kiamfast.control.netns import wire

log = logging.getLogger("kiamfast.netns")

NS_GET_NSTYPE = 0xB703        # linux/nsfs.h: _IO(0xb7, 0x3)
CLONE_NEWNET = 0x40000000
RETRY_FIRST, RETRY_MAX = 1.0, 30.0   # a namespace path that did not resolve is tried again


class SandboxLike(Protocol):
    id: str
    netns: str


@dataclass(frozen=True, slots=True)
class _Ref:
    nsid: int
    path: str


@dataclass(slots=True)
class _Unresolved:
    path: str
    retry_ns: int
    wait: float


class NetnsWatch:
    """`open()` once (in the network namespace the agent serves), `track()` the runtime's
    sandboxes, `drain()` whenever the socket is readable, `refresh()` before deciding, then
    ask `addresses_of()`."""

    def __init__(self, *, rcvbuf: int = wire.RCVBUF,
                 clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._rcvbuf = rcvbuf
        self._clock_ns = clock_ns
        self._events = None
        self._requests: wire.Requests | None = None
        self._own_ns: tuple[int, int] | None = None   # (st_dev, st_ino) of our namespace
        self._own: set[str] = set()                   # addresses of our namespace
        self._peers: dict[int, set[str]] = {}         # nsid -> addresses (dumped ones only)
        self._holders: Counter[str] = Counter()       # address -> namespaces holding it
        self._to_dump: set[int] = set()               # nsids whose addresses are to be read
        self._own_dirty = True
        self._list_nsids = True                       # the nsid list is to be read again
        self._refs: dict[str, _Ref] = {}              # sandbox id -> its namespace
        self._tracked: dict[str, str] = {}            # sandbox id -> netns path
        self._unresolved: dict[str, _Unresolved] = {}
        self.generation = 0
        self._counts = {"events": 0, "overruns": 0, "dumps": 0, "resolved": 0,
                        "unresolved": 0}

    # ---- life ---------------------------------------------------------------------------

    def open(self) -> None:
        """Subscribe, then read everything.  OSError (with the kernel's reason) where the
        agent may not: without CAP_NET_BROADCAST the subscription to other namespaces is
        refused (EPERM); without CAP_NET_ADMIN, their address dumps."""
        events = wire.subscribe(self._rcvbuf)
        try:
            requests = wire.Requests()
        except OSError:
            events.close()
            raise
        st = os.stat("/proc/self/ns/net")
        self._events, self._requests, self._own_ns = events, requests, (st.st_dev, st.st_ino)
        try:
            self.refresh()
            if self._own_dirty:        # the dumps were refused: say so now, not later
                raise OSError(errno.EPERM, "the kernel answers no address dump")
        except OSError:
            self.close()
            raise

    @property
    def watching(self) -> bool:
        return self._events is not None

    def fileno(self) -> int:
        assert self._events is not None
        return self._events.fileno()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        if self._requests is not None:
            self._requests.close()
        self._events = self._requests = None
        self._forget_all()
        self.generation += 1           # every answer is None from now on

    @property
    def counters(self) -> dict[str, int]:
        """Notifications read, overruns, dumps, namespaces resolved and not."""
        return dict(self._counts)

    @property
    def stats(self) -> dict[str, int]:
        return {**self._counts, "namespaces": len(self._peers), "sandboxes": len(self._refs)}

    # ---- the question -------------------------------------------------------------------

    def addresses_of(self, sandbox: SandboxLike) -> frozenset[str] | None:
        """The addresses configured in the sandbox's network namespace now and in no other
        namespace the watch sees; None if its namespace is not known."""
        ref = self._refs.get(sandbox.id)
        if ref is None or ref.path != sandbox.netns:
            return None
        held = self._peers.get(ref.nsid)
        if held is None:
            return None
        holders = self._holders
        return frozenset(ip for ip in held if holders[ip] == 1)

    # ---- the sandboxes ------------------------------------------------------------------

    def track(self, sandboxes: Iterable[SandboxLike]) -> None:
        """The runtime's sandboxes now: find the namespace of each new one, forget the
        namespaces of those that are gone."""
        wanted = {s.id: s.netns for s in sandboxes}
        for gone in [i for i in self._tracked if i not in wanted]:
            del self._tracked[gone]
            self._refs.pop(gone, None)
            self._unresolved.pop(gone, None)
        for sandbox_id, path in wanted.items():
            if self._tracked.get(sandbox_id) != path:
                self._tracked[sandbox_id] = path
                self._refs.pop(sandbox_id, None)
                self._unresolved.pop(sandbox_id, None)
        self._resolve_tracked()

    def _resolve_tracked(self) -> None:
        if self._requests is None:
            return
        now = self._clock_ns()
        changed = False
        for sandbox_id, path in list(self._tracked.items()):
            if sandbox_id in self._refs or self._requests is None:
                continue
            pending = self._unresolved.get(sandbox_id)
            if pending is not None and pending.retry_ns > now:
                continue
            ref = self._resolve(sandbox_id, path, logged=pending is not None)
            if ref is not None:
                self._refs[sandbox_id] = ref
                self._unresolved.pop(sandbox_id, None)
                changed = True
            else:
                wait = RETRY_FIRST if pending is None else min(RETRY_MAX, pending.wait * 2)
                self._unresolved[sandbox_id] = _Unresolved(path, now + round(wait * 1e9), wait)
        if changed:
            self.generation += 1

    def _resolve(self, sandbox_id: str, path: str, *, logged: bool) -> _Ref | None:
        """The nsid of the namespace at ``path``, its addresses read; None (logged once per
        sandbox) when it cannot be known."""
        assert self._requests is not None
        why = ""
        fd = -1
        try:
            if not path:
                why = "the runtime names no network namespace for it"
            else:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                st = os.fstat(fd)
                if fcntl.ioctl(fd, NS_GET_NSTYPE) != CLONE_NEWNET:
                    why = f"{path} is not a network namespace"
                elif (st.st_dev, st.st_ino) == self._own_ns:
                    why = f"{path} is the agent's own network namespace"
                else:
                    nsid = self._requests.nsid(fd)
                    if nsid == wire.NSID_NOT_ASSIGNED:
                        self._requests.assign_nsid(fd)
                        nsid = self._requests.nsid(fd)
                    if nsid == wire.NSID_NOT_ASSIGNED:
                        why = f"the kernel gave {path} no nsid"
                    else:
                        self.drain()             # what happened to that nsid before now
                        if self._requests is None:
                            return None          # the watch gave up (logged)
                        if nsid not in self._peers or nsid in self._to_dump:
                            self._dump(nsid)     # while it is open: it is this namespace
                        if nsid in self._peers:
                            self._counts["resolved"] += 1
                            return _Ref(nsid, path)
                        why = f"the addresses of {path} could not be read"
        except OSError as exc:
            why = f"{path}: {exc.strerror or exc}"
        finally:
            if fd >= 0:
                os.close(fd)
        self._counts["unresolved"] += 1
        if not logged:
            log.warning("sandbox %s: its network namespace cannot be read (%s): it owns no "
                        "address until it can (mount the runtime's network namespace "
                        "directory into the agent: docs/install.md)", sandbox_id[:13], why)
        return None

    # ---- notifications ------------------------------------------------------------------

    def drain(self) -> bool:
        """Apply every pending notification; True if an answer may have changed."""
        if self._events is None:
            return False
        before = self.generation
        overrun = False
        while True:
            try:
                buf, nsid = wire.receive(self._events)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    overrun = True      # notifications were lost: read everything again
                    continue
                log.error("namespace notifications cannot be read (%s): no address has a "
                          "proven owner any more", e)
                self.close()
                return True
            for kind, _, _, payload in wire.messages(buf):
                self._counts["events"] += 1
                self._note(kind, payload, nsid)
        if overrun:
            self._counts["overruns"] += 1
            log.warning("namespace notifications were lost (socket overrun): reading every "
                        "namespace's addresses again")
            self._forget_all()
            self.generation += 1
        return self.generation != before

    def _note(self, kind: int, payload: bytes, nsid: int | None) -> None:
        if kind in (wire.RTM_NEWADDR, wire.RTM_DELADDR):
            ip, usable = wire.ifaddr(payload)
            if ip is None:
                return
            held = self._own if nsid is None else self._peers.get(nsid)
            if held is None:            # not read yet: its dump will have it
                self._to_dump.add(nsid)  # type: ignore[arg-type]
                return
            if kind == wire.RTM_NEWADDR and usable:
                if ip not in held:
                    held.add(ip)
                    self._holders[ip] += 1
                    self.generation += 1
            elif ip in held:
                held.discard(ip)
                self._drop_holder(ip)
                self.generation += 1
        elif kind in (wire.RTM_NEWNSID, wire.RTM_DELNSID) and nsid is None:
            peer = wire.nsid_of(payload)
            if peer is None:
                return
            if kind == wire.RTM_NEWNSID:
                self._to_dump.add(peer)
            else:
                # That namespace is gone (its nsid may be the next one's): forget it and
                # find the sandboxes that named it again from their paths.  The list is read
                # again too: the kernel may tell a reuse before the removal it follows.
                self._forget_peer(peer)
                self._to_dump.discard(peer)
                self._list_nsids = True
                for sandbox_id in [i for i, r in self._refs.items() if r.nsid == peer]:
                    del self._refs[sandbox_id]
                self.generation += 1

    # ---- dumps --------------------------------------------------------------------------

    def refresh(self) -> None:
        """Drain, then read what is not known yet: our own addresses, the nsid list, the
        addresses of new nsids, the namespaces of sandboxes not resolved."""
        if self._requests is None:
            return
        self.drain()
        try:
            if self._own_dirty:
                payloads = self._requests.addresses(None)
                if payloads is not None:
                    self._set_addresses(None, payloads)
                    self._own_dirty = False
            if self._list_nsids:
                listed = self._requests.nsids()
                if listed is not None:
                    self._list_nsids = False
                    self._to_dump.update(n for n in listed if n not in self._peers)
            for nsid in sorted(self._to_dump):
                self._dump(nsid)
        except OSError as e:
            log.warning("cannot read the namespaces' addresses: %s", e)
        self._resolve_tracked()

    def _dump(self, nsid: int) -> None:
        assert self._requests is not None
        self._to_dump.discard(nsid)
        try:
            payloads = self._requests.addresses(nsid)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOENT):   # that nsid is gone meanwhile
                self._forget_peer(nsid)
                return
            raise
        if payloads is None:
            self._to_dump.add(nsid)     # it kept changing: next time
            return
        self._set_addresses(nsid, payloads)

    def _set_addresses(self, nsid: int | None, payloads: list[bytes]) -> None:
        self._counts["dumps"] += 1
        found = set()
        for payload in payloads:
            ip, usable = wire.ifaddr(payload)
            if ip is not None and usable:
                found.add(ip)
        old = self._own if nsid is None else self._peers.get(nsid, set())
        for ip in old - found:
            self._drop_holder(ip)
        for ip in found - old:
            self._holders[ip] += 1
        if nsid is None:
            self._own = found
        else:
            self._peers[nsid] = found
        if found != old:
            self.generation += 1

    def _drop_holder(self, ip: str) -> None:
        self._holders[ip] -= 1
        if self._holders[ip] <= 0:
            del self._holders[ip]

    def _forget_peer(self, nsid: int) -> None:
        for ip in self._peers.pop(nsid, ()):
            self._drop_holder(ip)

    def _forget_all(self) -> None:
        self._own, self._peers, self._holders = set(), {}, Counter()
        self._refs.clear()
        self._unresolved.clear()
        self._to_dump.clear()
        self._own_dirty = self._list_nsids = True
