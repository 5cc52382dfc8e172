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

It never changes the kernel's state, and it reads only the agent's own network namespace.
"""
from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger("kiamfast.routes")

# linux/netlink.h, rtnetlink.h, if_link.h, fib_rules.h
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP, NLM_F_DUMP_INTR = 0x1, 0x300, 0x10
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWRULE, RTM_DELRULE, RTM_GETRULE = 32, 33, 34
# RTMGRP_LINK, _IPV4_ROUTE, _IPV4_RULE, _IPV6_ROUTE, and RTNLGRP_IPV6_RULE (19)
GROUPS = 0x1 | 0x40 | 0x80 | 0x400 | (1 << (19 - 1))
IFF_UP = 0x1
IFLA_IFNAME, IFLA_LINKINFO, IFLA_EXT_MASK, IFLA_LINK_NETNSID = 3, 18, 29, 37
IFLA_INFO_KIND = 1
RTEXT_FILTER_SKIP_STATS = 1 << 3
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_MULTIPATH, RTA_TABLE = 1, 4, 5, 9, 15
RTA_VIA, RTA_ENCAP, RTA_NH_ID = 18, 22, 30
RTN_UNICAST, RTN_LOCAL = 1, 2
NOT_PLAIN = frozenset({RTA_GATEWAY, RTA_VIA, RTA_MULTIPATH, RTA_NH_ID, RTA_ENCAP})
RT_TABLE_MAIN, RT_TABLE_LOCAL = 254, 255
FRA_DST, FRA_SRC, FRA_IIFNAME, FRA_GOTO, FRA_PRIORITY = 1, 2, 3, 4, 6
FRA_FLOW, FRA_SUPPRESS_IFGROUP, FRA_SUPPRESS_PREFIXLEN, FRA_TABLE = 11, 13, 14, 15
FRA_PAD, FRA_PROTOCOL = 18, 21
FR_ACT_TO_TBL, FR_ACT_NOP = 1, 3
FR_ACT_DROPS = frozenset({6, 7, 8})          # blackhole, unreachable, prohibit
FIB_RULE_INVERT = 0x2
# What a rule carries besides its selectors (FRA_FLOW only tags the packet's realm).
RULE_NOT_SELECTORS = frozenset({FRA_PRIORITY, FRA_TABLE, FRA_GOTO, FRA_PROTOCOL, FRA_PAD,
                                FRA_FLOW, FRA_SUPPRESS_IFGROUP, FRA_SUPPRESS_PREFIXLEN})

NLMSGHDR = struct.Struct("=IHHII")           # len, type, flags, seq, pid
IFINFOMSG = struct.Struct("=BxHiII")         # family, type, index, flags, change
RTMSG = struct.Struct("=BBBBBBBBI")          # family, dst_len, src_len, tos, table, proto,
                                             # scope, type, flags (fib_rule_hdr: the same
                                             # layout with res1, res2, action)
RTATTR = struct.Struct("=HH")
U32 = struct.Struct("=I")
UNSET = U32.pack(0xFFFFFFFF)

FAMILIES = {socket.AF_INET: 4, socket.AF_INET6: 6}
HOST_LEN = {4: 32, 6: 128}
RCVBUF = 4 << 20
SO_RCVBUFFORCE, SOL_NETLINK, NETLINK_GET_STRICT_CHK = 33, 270, 12
DUMP_TRIES = 3


def _attrs(data: bytes, offset: int) -> dict[int, bytes]:
    """The netlink attributes from `offset` to the end of `data` (type -> payload)."""
    out: dict[int, bytes] = {}
    end = len(data)
    unpack = RTATTR.unpack_from
    while offset + 4 <= end:
        length, kind = unpack(data, offset)
        if length < 4:
            break
        out[kind & 0x3FFF] = data[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return out


def _messages(buf: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + NLMSGHDR.size <= len(buf):
        length, kind, flags, seq, _ = NLMSGHDR.unpack_from(buf, offset)
        if length < NLMSGHDR.size:
            break
        yield kind, flags, seq, buf[offset + NLMSGHDR.size:offset + length]
        offset += (length + 3) & ~3


def _address(raw: bytes | None) -> str | None:
    """The address in ownership.canonical_ip's spelling."""
    if raw is not None and len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    try:
        return ipaddress.ip_address(raw).compressed if raw is not None else None
    except ValueError:
        return None


# A prefix as (address bits, value, length): cheap to build from a message and to compare.
Prefix = tuple[int, int, int]


def _prefix(raw: bytes, length: int) -> Prefix:
    return (len(raw) * 8, int.from_bytes(raw, "big"), length)


def _overlap(a: Prefix, b: Prefix) -> bool:
    if a[0] != b[0]:
        return False
    shift = a[0] - min(a[2], b[2])
    return a[1] >> shift == b[1] >> shift


@dataclass(frozen=True, slots=True)
class Rule:
    """A policy routing rule, as much of it as decides whether it may divert a reply."""
    family: int                  # 4 or 6
    action: int
    table: int
    invert: bool
    src: Prefix | None
    iifname: str | None
    selectors: frozenset[int]    # other selectors present ("to", tos, marks, ports, ...)
    suppressed: bool             # suppress_prefixlength / suppress_ifgroup set

    @property
    def catch_all_main(self) -> bool:
        """``from all lookup main``: from here on the main table decides."""
        return (self.action == FR_ACT_TO_TBL and self.table == RT_TABLE_MAIN
                and not self.invert and self.src is None and self.iifname is None
                and not self.selectors and not self.suppressed)

    @property
    def harmless_by_action(self) -> bool:
        return (self.action == FR_ACT_NOP or self.action in FR_ACT_DROPS
                or (self.action == FR_ACT_TO_TBL
                    and self.table in (RT_TABLE_MAIN, RT_TABLE_LOCAL)))

    @property
    def keyed_on_source(self) -> bool:
        """Is it harmless only for its source selector (`inert`)?"""
        return (self.src is not None and not self.invert and self.iifname is None
                and not self.harmless_by_action)


def parse_rule(payload: bytes) -> Rule | None:
    family, dst_len, src_len, tos, table, _, _, action, flags = RTMSG.unpack_from(payload)
    fam = FAMILIES.get(family)
    if fam is None:
        return None
    attrs = _attrs(payload, RTMSG.size)
    if FRA_TABLE in attrs:
        table = U32.unpack(attrs[FRA_TABLE][:4])[0]
    src = _prefix(attrs[FRA_SRC], src_len) if src_len and FRA_SRC in attrs else None
    iif = attrs.get(FRA_IIFNAME)
    selectors = {k for k in attrs if k not in RULE_NOT_SELECTORS
                 and k not in (FRA_SRC, FRA_IIFNAME)}
    if dst_len:
        selectors.add(FRA_DST)
    if tos:
        selectors.add(-1)                           # no attribute: the header's tos
    if src_len and src is None:
        selectors.add(FRA_SRC)
    return Rule(family=fam, action=action, table=table, invert=bool(flags & FIB_RULE_INVERT),
                src=src, iifname=iif.rstrip(b"\0").decode(errors="replace") if iif else None,
                selectors=frozenset(selectors),
                # the kernel sends both always, 0xffffffff (-1) meaning unset
                suppressed=any(attrs.get(k, UNSET) != UNSET
                               for k in (FRA_SUPPRESS_PREFIXLEN, FRA_SUPPRESS_IFGROUP)))


def inert(rule: Rule, local: Counter) -> bool:
    """Can this rule, in front of the main table, never send the agent's reply to a pod
    anywhere but where the main table does?

    * a lookup of the main table (whatever selects it), or of the local table (its routes
      to the host's own addresses keep a reply in the host; a unicast route someone put
      there leaves no evidence, `path_kept`), a nop, or a drop (a dropped reply reaches
      nobody);
    * a rule for traffic arriving on an interface other than ``lo``: the agent's replies
      are generated locally (the kernel matches them as arriving on ``lo``);
    * a rule for traffic from a prefix that holds no local address of the host: a reply
      leaves from the address the pod connected to, a local one (the AWS VPC CNI's
      ``from <pod> lookup <eni table>``).
    Anything else (another table for all or for marked traffic, ``goto``, an inverted
    selector, a VRF's ``l3mdev`` rule) may divert it."""
    if rule.harmless_by_action:
        return True
    if rule.invert:
        return False
    if rule.iifname is not None and rule.iifname != "lo":
        return True
    if rule.src is not None:
        return not any(_overlap(rule.src, p) for p in local)
    return False


def policy_inert(rules: list[Rule], local: Counter) -> bool:
    """Do replies reach the main table, through rules (in the kernel's order) that cannot
    divert them?"""
    for rule in rules:
        if rule.catch_all_main:
            return True
        if not inert(rule, local):
            return False
    return False


def _qualifying_link(flags: int, attrs: dict[int, bytes]) -> bool:
    """Up, a veth, its peer in another network namespace: a pod's host end."""
    kind = _attrs(attrs.get(IFLA_LINKINFO, b""), 0).get(IFLA_INFO_KIND, b"")
    return bool(flags & IFF_UP) and kind.rstrip(b"\0") == b"veth" \
        and IFLA_LINK_NETNSID in attrs


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
        self._clock_ns = clock_ns
        self._rcvbuf = rcvbuf
        self._events: socket.socket | None = None
        self._dumps: socket.socket | None = None
        self._strict = False                   # the kernel filters dumps (Linux >= 4.20)
        self._seq = 0
        self._fam = {4: _Family(), 6: _Family()}
        self._veths: set[int] = set()          # pods' host ends (`_qualifying_link`)
        self._links_dirty = True               # the link dump is to be taken (again)
        self._on_link: dict[int, set[str]] = {}   # ifindex -> addresses routed on it
        self._touched: dict[str, int] = {}     # ip -> when a change to its route was read
        self._reset_ns: int | None = None      # evidence is continuous from here (None: never)
        self.generation = 0                    # bumped whenever an answer may have changed
        self.stats = {"events": 0, "dumps": 0, "overruns": 0, "dump_errors": 0}
        self._logged_inert: dict[int, bool] = {}

    # ---- life ---------------------------------------------------------------------------

    def open(self) -> bool:
        """Subscribe, then read everything; False (logged) where rtnetlink cannot be used:
        then every answer is None and the fallback keeps its strict rule."""
        try:
            events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK
                                   | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
            try:   # SO_RCVBUFFORCE needs CAP_NET_ADMIN; without it rmem_max caps the size
                events.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, self._rcvbuf)
            except OSError:
                events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._rcvbuf)
            events.bind((0, GROUPS))
            start = self._clock_ns()   # every change from here on is in the socket
            dumps = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                  socket.NETLINK_ROUTE)
            dumps.settimeout(2.0)
            dumps.bind((0, 0))
        except OSError as e:
            log.warning("cannot watch the host's routes (rtnetlink: %s): while the container "
                        "runtime cannot be asked, an unplaced new pod makes every address "
                        "wait", e)
            return False
        try:
            dumps.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
            self._strict = True
        except OSError:
            self._strict = False       # older kernels: whole dumps, filtered here
        self._events, self._dumps = events, dumps
        self._reset_ns = start
        self.refresh()
        return True

    @property
    def watching(self) -> bool:
        return self._events is not None

    def fileno(self) -> int:
        assert self._events is not None
        return self._events.fileno()

    def close(self) -> None:
        for sock in (self._events, self._dumps):
            if sock is not None:
                sock.close()
        self._events = self._dumps = None
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
            for kind, _, _, payload in _messages(buf):
                self.stats["events"] += 1
                self._note(kind, payload, touched, policy)
        now = self._clock_ns()
        if overrun:
            self.stats["overruns"] += 1
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
            _, _, index, flags, _ = IFINFOMSG.unpack_from(payload)
            touched.update(self._on_link.get(index, ()))    # any change of a pod's link
            if kind == RTM_NEWLINK and _qualifying_link(flags, _attrs(payload, IFINFOMSG.size)):
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
            attrs = _attrs(payload, RTMSG.size)
            ip = _address(attrs.get(RTA_DST))
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
            dst = _attrs(payload, RTMSG.size).get(RTA_DST)
            if dst is None:
                return
            prefix = _prefix(dst, dst_len)
            if kind == RTM_DELROUTE:
                fam.local[prefix] -= 1
                fam.local += Counter()
            else:
                fam.local[prefix] += 1
                if any(_overlap(prefix, p) for p in fam.from_prefixes):
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
            self.stats["dump_errors"] += 1
            log.warning("cannot read the host's routes: %s", e)
        if changed:
            self.generation += 1
        if prune_before_ns is not None:
            horizon = min(prune_before_ns, *(f.routes_ns for f in self._fam.values()))
            self._touched = {ip: t for ip, t in self._touched.items() if t > horizon}

    def _dump(self, kind: int, header: bytes) -> list[bytes] | None:
        """One dump's payloads, or None if the kernel says it was interrupted."""
        assert self._dumps is not None
        self._seq += 1
        seq = self._seq
        msg = NLMSGHDR.pack(NLMSGHDR.size + len(header), kind, NLM_F_REQUEST | NLM_F_DUMP,
                            seq, 0) + header
        self._dumps.send(msg)
        out: list[bytes] = []
        interrupted = False
        while True:
            buf = self._dumps.recv(1 << 20)
            for mkind, flags, mseq, payload in _messages(buf):
                if mseq != seq:
                    continue            # the rest of an earlier dump that failed half-way
                if flags & NLM_F_DUMP_INTR:
                    interrupted = True
                if mkind == NLMSG_DONE:
                    self.stats["dumps"] += 1
                    return None if interrupted else out
                if mkind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code == 0:
                        continue
                    raise OSError(code, f"rtnetlink dump: {errno.errorcode.get(code, code)}")
                out.append(payload)

    def _consistent_dump(self, kind: int, header: bytes) -> tuple[int, list[bytes]] | None:
        """(when it began, payloads) of a dump the kernel did not see change under it."""
        for _ in range(DUMP_TRIES):
            started = self._clock_ns()
            payloads = self._dump(kind, header)
            if payloads is not None:
                return started, payloads
        log.warning("rtnetlink dump %d kept changing under us; trying again later", kind)
        return None

    def _dump_links(self) -> bool:
        """Every link once (at start, after an overrun); notifications keep it current:
        each carries the whole link."""
        mask = RTATTR.pack(8, IFLA_EXT_MASK) + U32.pack(RTEXT_FILTER_SKIP_STATS)
        got = self._consistent_dump(RTM_GETLINK, IFINFOMSG.pack(0, 0, 0, 0, 0) + mask)
        if got is None:
            return False
        veths = set()
        for payload in got[1]:
            _, _, index, flags, _ = IFINFOMSG.unpack_from(payload)
            if _qualifying_link(flags, _attrs(payload, IFINFOMSG.size)):
                veths.add(index)
        # What changed during the dump is still in the socket: the next drain applies it on
        # top (each notification sets the whole link, so a replay ends in the right state).
        self._veths, self._links_dirty = veths, False
        return True

    def _route_dump(self, family: int, table: int) -> tuple[int, list[bytes]] | None:
        # with strict checking the kernel sends only that table
        header = RTMSG.pack(family, 0, 0, 0, table if self._strict else 0, 0, 0, 0, 0)
        return self._consistent_dump(RTM_GETROUTE, header)

    def _dump_routes(self, fam_no: int) -> bool:
        family = socket.AF_INET if fam_no == 4 else socket.AF_INET6
        fam = self._fam[fam_no]
        host_len = HOST_LEN[fam_no]
        if fam.local_dirty:
            got = self._route_dump(family, RT_TABLE_LOCAL)
            if got is None:
                return False
            local: Counter = Counter()
            fam.local_unicast = 0
            for payload in got[1]:
                _, dst_len, _, _, table, _, _, rtype, _ = RTMSG.unpack_from(payload)
                if table == RT_TABLE_LOCAL and rtype == RTN_UNICAST:
                    fam.local_unicast += 1
                elif table == RT_TABLE_LOCAL and rtype == RTN_LOCAL:
                    dst = _attrs(payload, RTMSG.size).get(RTA_DST)
                    if dst is not None:
                        local[_prefix(dst, dst_len)] += 1
            fam.local, fam.local_dirty = local, False
        got = self._route_dump(family, RT_TABLE_MAIN)
        if got is None:
            return False
        started, payloads = got
        host: dict[str, list[tuple[int, bool]]] = {}
        on_link: dict[int, set[str]] = {}
        for payload in payloads:
            _, dst_len, _, _, table, _, _, rtype, _ = RTMSG.unpack_from(payload)
            if table != RT_TABLE_MAIN or dst_len != host_len:
                continue
            attrs = _attrs(payload, RTMSG.size)
            ip = _address(attrs.get(RTA_DST))
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
        family = socket.AF_INET if fam_no == 4 else socket.AF_INET6
        got = self._consistent_dump(RTM_GETRULE, RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0))
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
