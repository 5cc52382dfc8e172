"""rtnetlink for the route witness (`routes.py`): the constants, message and attribute
framing, addresses, and the policy rules that cannot send a reply of the agent elsewhere
(`inert`).  Plain `socket.AF_NETLINK`, no dependency."""
from __future__ import annotations

import ipaddress
import socket
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

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
