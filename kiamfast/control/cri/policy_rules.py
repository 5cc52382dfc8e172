"""Policy routing rules (``ip rule``) that cannot send a reply of the agent anywhere the main
table would not: the route witness (`routes.py`) trusts a family's host routes only while
every rule in front of ``from all lookup main`` is one of those (`policy_inert`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kiamfast.control.cri.netlink import (FAMILIES, FRA_DST, FRA_GOTO, FRA_IIFNAME, FRA_PAD,
                                          FRA_PRIORITY, FRA_PROTOCOL, FRA_FLOW, FRA_SRC,
                                          FRA_SUPPRESS_IFGROUP, FRA_SUPPRESS_PREFIXLEN,
                                          FRA_TABLE, RT_TABLE_LOCAL, RT_TABLE_MAIN, RTMSG, U32,
                                          Prefix, attributes, overlap, prefix)

FR_ACT_TO_TBL, FR_ACT_NOP = 1, 3
FR_ACT_DROPS = frozenset({6, 7, 8})          # blackhole, unreachable, prohibit
FIB_RULE_INVERT = 0x2
# What a rule carries besides its selectors (FRA_FLOW only tags the packet's realm).
RULE_NOT_SELECTORS = frozenset({FRA_PRIORITY, FRA_TABLE, FRA_GOTO, FRA_PROTOCOL, FRA_PAD,
                                FRA_FLOW, FRA_SUPPRESS_IFGROUP, FRA_SUPPRESS_PREFIXLEN})
UNSET = U32.pack(0xFFFFFFFF)


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
    attrs = attributes(payload, RTMSG.size)
    if FRA_TABLE in attrs:
        table = U32.unpack(attrs[FRA_TABLE][:4])[0]
    src = prefix(attrs[FRA_SRC], src_len) if src_len and FRA_SRC in attrs else None
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
        return not any(overlap(rule.src, p) for p in local)
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
