"""rtnetlink, the wire of the route witness (`routes.py`): constants, message and attribute
framing, addresses and prefixes, the notification socket, and dumps (a request, its answer
read to the end, retried while the kernel says it changed underneath).  Plain
`socket.AF_NETLINK`, no dependency; what the messages prove is `routes.py`'s and
`policy_rules.py`'s."""
from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable, Iterator

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

NLMSGHDR = struct.Struct("=IHHII")           # len, type, flags, seq, pid
IFINFOMSG = struct.Struct("=BxHiII")         # family, type, index, flags, change
RTMSG = struct.Struct("=BBBBBBBBI")          # family, dst_len, src_len, tos, table, proto,
                                             # scope, type, flags (fib_rule_hdr: the same
                                             # layout with res1, res2, action)
RTATTR = struct.Struct("=HH")
U32 = struct.Struct("=I")

FAMILIES = {socket.AF_INET: 4, socket.AF_INET6: 6}
HOST_LEN = {4: 32, 6: 128}
RCVBUF = 4 << 20
SO_RCVBUFFORCE, SOL_NETLINK, NETLINK_GET_STRICT_CHK = 33, 270, 12
DUMP_TRIES = 3


def attributes(data: bytes, offset: int) -> dict[int, bytes]:
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


def messages(buf: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) of each netlink message in one datagram."""
    offset = 0
    while offset + NLMSGHDR.size <= len(buf):
        length, kind, flags, seq, _ = NLMSGHDR.unpack_from(buf, offset)
        if length < NLMSGHDR.size:
            break
        yield kind, flags, seq, buf[offset + NLMSGHDR.size:offset + length]
        offset += (length + 3) & ~3


def address(raw: bytes | None) -> str | None:
    """The address in mappings.addresses.canonical_ip's spelling."""
    if raw is not None and len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw)
    try:
        return ipaddress.ip_address(raw).compressed if raw is not None else None
    except ValueError:
        return None


# A prefix as (address bits, value, length): cheap to build from a message and to compare.
Prefix = tuple[int, int, int]


def prefix(raw: bytes, length: int) -> Prefix:
    return (len(raw) * 8, int.from_bytes(raw, "big"), length)


def overlap(a: Prefix, b: Prefix) -> bool:
    if a[0] != b[0]:
        return False
    shift = a[0] - min(a[2], b[2])
    return a[1] >> shift == b[1] >> shift


def subscribe(rcvbuf: int) -> socket.socket:
    """A non-blocking socket that receives the link, route and rule notifications."""
    events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK
                           | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
    try:   # SO_RCVBUFFORCE needs CAP_NET_ADMIN; without it rmem_max caps the size
        events.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
    except OSError:
        events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    events.bind((0, GROUPS))
    return events


class Dumps:
    """A socket for dump requests, one at a time.  `OSError` from the socket or the kernel
    goes to the caller."""

    def __init__(self, *, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._clock_ns = clock_ns
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                   socket.NETLINK_ROUTE)
        self._sock.settimeout(2.0)
        self._sock.bind((0, 0))
        self._seq = 0
        self.strict = False    # the kernel filters dumps (Linux >= 4.20)
        self.done = 0          # dumps read to the end

    def ask_strict(self) -> None:
        try:
            self._sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
            self.strict = True
        except OSError:
            self.strict = False       # older kernels: whole dumps, filtered by the reader

    def close(self) -> None:
        self._sock.close()

    def links(self) -> tuple[int, list[bytes]] | None:
        mask = RTATTR.pack(8, IFLA_EXT_MASK) + U32.pack(RTEXT_FILTER_SKIP_STATS)
        return self.consistent(RTM_GETLINK, IFINFOMSG.pack(0, 0, 0, 0, 0) + mask)

    def routes(self, family: int, table: int) -> tuple[int, list[bytes]] | None:
        # with strict checking the kernel sends only that table
        header = RTMSG.pack(family, 0, 0, 0, table if self.strict else 0, 0, 0, 0, 0)
        return self.consistent(RTM_GETROUTE, header)

    def rules(self, family: int) -> tuple[int, list[bytes]] | None:
        return self.consistent(RTM_GETRULE, RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0))

    def consistent(self, kind: int, header: bytes) -> tuple[int, list[bytes]] | None:
        """(when it began, payloads) of a dump the kernel did not see change under it."""
        for _ in range(DUMP_TRIES):
            started = self._clock_ns()
            payloads = self.dump(kind, header)
            if payloads is not None:
                return started, payloads
        log.warning("rtnetlink dump %d kept changing under us; trying again later", kind)
        return None

    def dump(self, kind: int, header: bytes) -> list[bytes] | None:
        """One dump's payloads, or None if the kernel says it was interrupted."""
        self._seq += 1
        seq = self._seq
        msg = NLMSGHDR.pack(NLMSGHDR.size + len(header), kind, NLM_F_REQUEST | NLM_F_DUMP,
                            seq, 0) + header
        self._sock.send(msg)
        out: list[bytes] = []
        interrupted = False
        while True:
            buf = self._sock.recv(1 << 20)
            for mkind, flags, mseq, payload in messages(buf):
                if mseq != seq:
                    continue            # the rest of an earlier dump that failed half-way
                if flags & NLM_F_DUMP_INTR:
                    interrupted = True
                if mkind == NLMSG_DONE:
                    self.done += 1
                    return None if interrupted else out
                if mkind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code == 0:
                        continue
                    raise OSError(code, f"rtnetlink dump: {errno.errorcode.get(code, code)}")
                out.append(payload)
