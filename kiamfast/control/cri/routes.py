"""Where a reply to a pod's address goes, from the node's own kernel: the runtime fallback's
second witness.

While the container runtime cannot be asked, its last view is old evidence
(`kiamfast.control.mappings.merge`).  Most CNIs give every pod a veth and put a host
route to the pod's address on the veth's host end (the CNI `ptp` plugin, Calico's
``caliXXXX``, the AWS VPC CNI's ``eniXXXX``: ``X dev <veth> scope link``).  The agent's
reply to X follows that route into the pod's network namespace, so only that sandbox's
processes can read it.  A new sandbox brings a new veth and a new route; the old veth dies
with the old sandbox's network namespace.  So: **if nothing about X's route, its link or
the policy rules in front of the main table changed since the runtime's last view began,
a reply to X still goes to the sandbox that view showed on X** (docs/architecture.md,
"While the runtime cannot be asked").

Why notifications, not a comparison of interface indexes: Linux hands out a fresh ifindex
in increasing order (``dev_index_reserve``, cyclic up to INT_MAX), but a device moved into
a namespace keeps the index it had if that index is free there.  Calico and the AWS VPC CNI
create the veth pair inside the pod's namespace and move the host end out
(``LinkSetNsFd``), so the next pod's host end can arrive with the index the dead pod's had,
at once (checked on this kernel by the tests).  So `RouteWatch` listens: an rtnetlink socket
subscribed to the link, route and rule groups (plain `socket.AF_NETLINK`) records, for
every address, when the last change to its host route or to the link it is on was read;
a socket overrun (ENOBUFS: notifications lost) restarts the evidence from that moment.  The
state itself comes from dumps: the main table's routes and the rules again whenever a
notification said they changed; links once (each link notification carries the whole
link), and again after an overrun.

`path_kept(ip, since_ns)` answers:

* True: since ``since_ns`` (the runtime view's start) the watch missed nothing, X has
  exactly one main-table route of host length (``/32``, ``/128``), a plain unicast one
  (no gateway, no multipath, no nexthop object, no encapsulation) on a veth whose peer is
  in another network namespace, nothing touched that route or that link, and every policy
  rule in front of the catch-all ``lookup main`` rule is one that cannot send a reply of
  the agent elsewhere (`inert`);
* False: X's host route or its link changed since then: the sandbox behind X may have
  changed (the fallback takes its owner away);
* None: no evidence either way (no host route: bridge CNIs; policy rules that may send
  replies elsewhere; a VRF; the watch could not run or lost notifications).

It never changes the kernel's state and reads only the agent's network namespace.  The wire
is `netlink.py`; which policy rules cannot divert a reply, `policy_rules.py`.
"""
from __future__ import annotations

import errno
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kiamfast.control.cri.netlink import (FAMILIES, HOST_LEN, IFF_UP, IFINFOMSG, IFLA_INFO_KIND,
                                          IFLA_LINK_NETNSID, IFLA_LINKINFO, NOT_PLAIN, RCVBUF,
                                          RTA_DST, RTA_OIF, RTM_DELLINK, RTM_DELROUTE,
                                          RTM_NEWLINK, RTM_NEWROUTE, RTM_NEWRULE, RTM_DELRULE,
                                          RTMSG, RTN_LOCAL, RTN_UNICAST, RT_TABLE_LOCAL,
                                          RT_TABLE_MAIN, U32, Dumps, address, attributes,
                                          messages, overlap, prefix, subscribe)
from kiamfast.control.cri.policy_rules import Rule, inert, parse_rule, policy_inert

log = logging.getLogger("kiamfast.routes")


@dataclass(slots=True)
class _Family:
    """What the watch knows of one address family."""
    host: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)  # ip -> (oif, plain)
    local: Counter = field(default_factory=Counter)    # prefixes of the host's own addresses
    local_unicast: int = 0     # unicast routes in the local table (it is asked before main)
    rules: list[Rule] = field(default_factory=list)
    from_prefixes: Counter = field(default_factory=Counter)  # rules harmless by their source
    inert: bool = False
    routes_ns: int = -1        # when the last dump of the main table began
    rules_ns: int = -1         # when the last rule dump began
    routes_dirty: bool = True  # a host route changed since that dump
    local_dirty: bool = True   # the local table needs a dump (at start, after an overrun)
    rules_dirty: bool = True
    policy_changed_ns: int = -1  # the last change that may have let a rule divert replies


class RouteWatch:
    """The host's routes to pod addresses, and when each last changed.

    `open()` once (in the network namespace to watch), then `drain()` whenever the socket
    is readable, `refresh()` before deciding: it drains, then re-reads what a notification
    said changed.  `path_kept()` is the question the fallback asks."""

    def __init__(self, *, clock_ns: Callable[[], int] = time.monotonic_ns,
                 rcvbuf: int = RCVBUF) -> None:
        self._clock_ns, self._rcvbuf = clock_ns, rcvbuf
        self._events: socket.socket | None = None
        self._dumps: Dumps | None = None
        self._fam = {4: _Family(), 6: _Family()}
        self._veths: set[int] = set()          # pods' host ends (`_host_end`)
        self._links_dirty = True               # the link dump is to be taken (again)
        self._on_link: dict[int, set[str]] = {}   # ifindex -> addresses routed on it
        self._touched: dict[str, int] = {}     # ip -> when a change to its route was read
        self._reset_ns: int | None = None      # evidence is continuous from here (None: never)
        self.generation = 0                    # bumped whenever an answer may have changed
        self._counts = {"events": 0, "overruns": 0, "dump_errors": 0}
        self._logged_inert: dict[int, bool] = {}

    # ---- life ---------------------------------------------------------------------------

    def open(self) -> bool:
        """Subscribe, then read everything; False (logged) where rtnetlink cannot be used:
        then every answer is None and the fallback keeps its strict rule."""
        events = None
        try:
            events = subscribe(self._rcvbuf)
            start = self._clock_ns()   # every change from here on is in the socket
            dumps = Dumps(clock_ns=self._clock_ns)
        except OSError as e:
            if events is not None:     # the dump socket failed: leave no descriptor behind
                events.close()
            log.warning("cannot watch the host's routes (rtnetlink: %s): while the container "
                        "runtime cannot be asked, an unplaced new pod makes every address "
                        "wait", e)
            return False
        dumps.ask_strict()
        self._events, self._dumps = events, dumps
        self._reset_ns = start
        self.refresh()
        return True

    @property
    def watching(self) -> bool:
        return self._events is not None

    @property
    def stats(self) -> dict[str, int]:
        return {"events": self._counts["events"],
                "dumps": self._dumps.done if self._dumps is not None else 0,
                "overruns": self._counts["overruns"], "dump_errors": self._counts["dump_errors"]}

    def fileno(self) -> int:
        assert self._events is not None
        return self._events.fileno()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        if self._dumps is not None:
            self._dumps.close()         # (kept: its count stays in `stats`)
        self._events = None
        self._reset_ns = None
        self.generation += 1            # every answer is None from now on

    # ---- the question -------------------------------------------------------------------

    def path_kept(self, ip: str, since_ns: int) -> bool | None:
        """Has a reply to `ip` gone down the same pod veth ever since `since_ns`?  True,
        False (its route or link changed since), or None (no evidence)."""
        if self._reset_ns is None or self._reset_ns >= since_ns or self._links_dirty:
            return None                 # not watching all along: changes may be unseen
        touched = self._touched.get(ip, -1)
        if touched > since_ns:
            return False
        fam = self._fam[6 if ":" in ip else 4]
        if (touched > fam.routes_ns or self._reset_ns > min(fam.routes_ns, fam.rules_ns)
                or fam.local_dirty or fam.rules_dirty or fam.policy_changed_ns > since_ns
                or not fam.inert or fam.local_unicast):
            return None                 # state older than its last change, or policy
        entries = fam.host.get(ip)
        if not entries or len(entries) != 1:
            return None
        oif, plain = entries[0]
        return True if plain and oif in self._veths else None

    # ---- notifications ------------------------------------------------------------------

    def drain(self) -> None:
        """Read every pending notification; each change is dated when it was read (never
        earlier than it happened)."""
        if self._events is None:
            return
        touched: set[str] = set()
        policy: set[int] = set()
        overrun = False
        while True:
            try:
                buf = self._events.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    overrun = True      # notifications were lost: the state is unknown
                    continue
                log.error("route notifications cannot be read (%s): the host routes prove "
                          "nothing any more", e)
                self.close()
                return
            for kind, _, _, payload in messages(buf):
                self._counts["events"] += 1
                self._note(kind, payload, touched, policy)
        now = self._clock_ns()
        if overrun:
            self._counts["overruns"] += 1
            log.warning("route notifications were lost (socket overrun): the host routes "
                        "prove nothing about views before now")
            self._reset_ns = now       # (the kernel drops silently until the queue is empty)
            self._links_dirty = True
            for fam in self._fam.values():
                fam.routes_dirty = fam.local_dirty = fam.rules_dirty = True
        for ip in touched:
            self._touched[ip] = now
        for family in policy:
            self._fam[family].policy_changed_ns = now
        if touched or policy or overrun:
            self.generation += 1

    def _note(self, kind: int, payload: bytes, touched: set[str], policy: set[int]) -> None:
        if kind in (RTM_NEWLINK, RTM_DELLINK) and len(payload) >= IFINFOMSG.size:
            index, host_end = _host_end(payload)
            touched.update(self._on_link.get(index, ()))    # any change of a pod's link
            if kind == RTM_NEWLINK and host_end:
                self._veths.add(index)
            else:
                self._veths.discard(index)
            for fam in self._fam.values():
                if fam.local_unicast and kind == RTM_DELLINK:
                    fam.local_dirty = True  # its routes went silently: count them again
        elif kind in (RTM_NEWROUTE, RTM_DELROUTE) and len(payload) >= RTMSG.size:
            self._note_route(kind, payload, touched, policy)
        elif kind in (RTM_NEWRULE, RTM_DELRULE) and len(payload) >= RTMSG.size:
            rule = parse_rule(payload)
            if rule is None:
                return
            fam = self._fam[rule.family]
            if rule.catch_all_main or not inert(rule, fam.local):
                policy.add(rule.family)
                fam.rules_dirty = True
            elif rule.keyed_on_source:
                fam.from_prefixes[rule.src] += 1 if kind == RTM_NEWRULE else -1
                fam.from_prefixes += Counter()          # drop what fell to zero

    def _note_route(self, kind: int, payload: bytes, touched: set[str],
                    policy: set[int]) -> None:
        family, dst_len, _, _, table, _, _, rtype, _ = RTMSG.unpack_from(payload)
        fam_no = FAMILIES.get(family)
        if fam_no is None or table not in (RT_TABLE_MAIN, RT_TABLE_LOCAL):
            return                      # (ids above 255 show as 252 in the header)
        fam = self._fam[fam_no]
        if table == RT_TABLE_MAIN:
            if dst_len != HOST_LEN[fam_no]:
                return
            attrs = attributes(payload, RTMSG.size)
            ip = address(attrs.get(RTA_DST))
            if ip is not None:
                touched.add(ip)
                if RTA_OIF in attrs:
                    self._on_link.setdefault(U32.unpack(attrs[RTA_OIF][:4])[0], set()).add(ip)
                fam.routes_dirty = True
        elif rtype == RTN_UNICAST:
            # the local table is asked first: a unicast route there may take replies away
            fam.local_unicast = max(0, fam.local_unicast + (1 if kind == RTM_NEWROUTE else -1))
            if kind == RTM_NEWROUTE:
                policy.add(fam_no)
        elif rtype == RTN_LOCAL:
            dst = attributes(payload, RTMSG.size).get(RTA_DST)
            if dst is None:
                return
            own = prefix(dst, dst_len)
            if kind == RTM_DELROUTE:
                fam.local[own] -= 1
                fam.local += Counter()
            else:
                fam.local[own] += 1
                if any(overlap(own, p) for p in fam.from_prefixes):
                    policy.add(fam_no)          # a source rule may now match replies
                    fam.rules_dirty = True      # judge the rules again

    # ---- dumps --------------------------------------------------------------------------

    def refresh(self, *, prune_before_ns: int | None = None) -> None:
        """Drain, then read again what changed.  `prune_before_ns`: the start of a runtime
        view just taken; changes read before it (and before the dumps) can no longer
        matter to anyone asking about that view or a later one."""
        if self._events is None:
            return
        self.drain()
        changed = False
        try:
            if self._links_dirty:
                changed |= self._dump_links()
            for fam_no, fam in self._fam.items():
                if fam.routes_dirty or fam.local_dirty:
                    changed |= self._dump_routes(fam_no)
                if fam.rules_dirty:
                    changed |= self._dump_rules(fam_no)
        except OSError as e:   # the old state stays, dated as it was: answers are None
            self._counts["dump_errors"] += 1
            log.warning("cannot read the host's routes: %s", e)
        if changed:
            self.generation += 1
        if prune_before_ns is not None:
            horizon = min(prune_before_ns, *(f.routes_ns for f in self._fam.values()))
            self._touched = {ip: t for ip, t in self._touched.items() if t > horizon}

    def _dump_links(self) -> bool:
        """Every link once (at start, after an overrun); notifications keep it current:
        each carries the whole link."""
        assert self._dumps is not None
        got = self._dumps.links()
        if got is None:
            return False
        veths = {index for index, host_end in map(_host_end, got[1]) if host_end}
        # What changed during the dump is still in the socket: the next drain applies it on
        # top (each notification sets the whole link, so a replay ends in the right state).
        self._veths, self._links_dirty = veths, False
        return True

    def _dump_routes(self, fam_no: int) -> bool:
        family = socket.AF_INET if fam_no == 4 else socket.AF_INET6
        fam = self._fam[fam_no]
        host_len = HOST_LEN[fam_no]
        assert self._dumps is not None
        if fam.local_dirty:
            got = self._dumps.routes(family, RT_TABLE_LOCAL)
            if got is None:
                return False
            local: Counter = Counter()
            fam.local_unicast = 0
            for payload in got[1]:
                _, dst_len, _, _, table, _, _, rtype, _ = RTMSG.unpack_from(payload)
                if table == RT_TABLE_LOCAL and rtype == RTN_UNICAST:
                    fam.local_unicast += 1
                elif table == RT_TABLE_LOCAL and rtype == RTN_LOCAL:
                    dst = attributes(payload, RTMSG.size).get(RTA_DST)
                    if dst is not None:
                        local[prefix(dst, dst_len)] += 1
            fam.local, fam.local_dirty = local, False
        got = self._dumps.routes(family, RT_TABLE_MAIN)
        if got is None:
            return False
        started, payloads = got
        host: dict[str, list[tuple[int, bool]]] = {}
        on_link: dict[int, set[str]] = {}
        for payload in payloads:
            _, dst_len, _, _, table, _, _, rtype, _ = RTMSG.unpack_from(payload)
            if table != RT_TABLE_MAIN or dst_len != host_len:
                continue
            attrs = attributes(payload, RTMSG.size)
            ip = address(attrs.get(RTA_DST))
            if ip is None:
                continue
            oif = U32.unpack(attrs[RTA_OIF][:4])[0] if RTA_OIF in attrs else -1
            plain = rtype == RTN_UNICAST and oif > 0 and not attrs.keys() & NOT_PLAIN
            host.setdefault(ip, []).append((oif, plain))
            if oif > 0:
                on_link.setdefault(oif, set()).add(ip)
        for index, ips in list(self._on_link.items()):   # keep the other family's
            ips.difference_update([ip for ip in ips if (":" in ip) == (fam_no == 6)])
            if not ips:
                del self._on_link[index]
        for index, ips in on_link.items():
            self._on_link.setdefault(index, set()).update(ips)
        fam.host, fam.routes_ns, fam.routes_dirty = host, started, False
        self._judge_policy(fam_no)
        return True

    def _dump_rules(self, fam_no: int) -> bool:
        assert self._dumps is not None
        got = self._dumps.rules(socket.AF_INET if fam_no == 4 else socket.AF_INET6)
        if got is None:
            return False
        started, payloads = got
        rules = [r for r in map(parse_rule, payloads) if r is not None]
        fam = self._fam[fam_no]
        fam.rules, fam.rules_ns, fam.rules_dirty = rules, started, False
        fam.from_prefixes = Counter(r.src for r in rules if r.keyed_on_source)
        self._judge_policy(fam_no)
        return True

    def _judge_policy(self, fam_no: int) -> None:
        fam = self._fam[fam_no]
        was, fam.inert = fam.inert, policy_inert(fam.rules, fam.local)
        if was and not fam.inert:
            fam.policy_changed_ns = self._clock_ns()
        if self._logged_inert.get(fam_no) != fam.inert and not fam.rules_dirty:
            self._logged_inert[fam_no] = fam.inert
            if fam.inert:
                log.info("IPv%d policy routing leaves replies to pods to the main table: "
                         "host routes can prove an address's owner", fam_no)
            else:
                log.warning("IPv%d policy routing has rules that may send replies to pods "
                            "elsewhere: while the container runtime cannot be asked, an "
                            "unplaced new pod makes every IPv%d address wait", fam_no, fam_no)


def _host_end(payload: bytes) -> tuple[int, bool]:
    """(ifindex, whether it is a pod's host end: up, a veth, its peer in another network
    namespace) of a link message."""
    _, _, index, flags, _ = IFINFOMSG.unpack_from(payload)
    attrs = attributes(payload, IFINFOMSG.size)
    kind = attributes(attrs.get(IFLA_LINKINFO, b""), 0).get(IFLA_INFO_KIND, b"")
    return index, (bool(flags & IFF_UP) and kind.rstrip(b"\0") == b"veth"
                   and IFLA_LINK_NETNSID in attrs)
