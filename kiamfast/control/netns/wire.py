"""rtnetlink, the wire of the namespace watch (`watch.py`): constants, message and attribute
framing, addresses, the notification socket, and requests (one answer, or a dump read to the
end, retried while the kernel says it changed underneath).  Plain `socket.AF_NETLINK`, no
dependency; what the messages prove is `watch.py`'s."""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Iterator

# linux/netlink.h, rtnetlink.h, if_addr.h, net_namespace.h
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP, NLM_F_DUMP_INTR = 0x1, 0x4, 0x300, 0x10
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWNSID, RTM_DELNSID, RTM_GETNSID = 88, 89, 90
# RTNLGRP_IPV4_IFADDR (5), RTNLGRP_IPV6_IFADDR (9), RTNLGRP_NSID (28), as bind() wants them
GROUPS = (1 << (5 - 1)) | (1 << (9 - 1)) | (1 << (28 - 1))
IFA_ADDRESS, IFA_LOCAL, IFA_FLAGS, IFA_TARGET_NETNSID = 1, 2, 8, 10
IFA_F_DADFAILED = 0x08
NETNSA_NSID, NETNSA_FD = 1, 3
NSID_NOT_ASSIGNED = -1
SOL_NETLINK = 270
NETLINK_LISTEN_ALL_NSID, NETLINK_GET_STRICT_CHK = 8, 12
SO_RCVBUFFORCE = 33

NLMSGHDR = struct.Struct("=IHHII")      # len, type, flags, seq, pid
IFADDRMSG = struct.Struct("=BBBBI")     # family, prefixlen, flags, scope, index
RTGENMSG = struct.Struct("=Bxxx")       # family (padded as the kernel reads it)
RTATTR = struct.Struct("=HH")
S32 = struct.Struct("=i")
U32 = struct.Struct("=I")

RCVBUF = 4 << 20
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


def attribute(kind: int, payload: bytes) -> bytes:
    length = RTATTR.size + len(payload)
    return RTATTR.pack(length, kind) + payload + b"\0" * (-length % 4)


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


def ifaddr(payload: bytes) -> tuple[str | None, bool]:
    """(the local address of an RTM_NEWADDR/DELADDR, whether it may be someone's): the local
    end (IFA_LOCAL; IFA_ADDRESS is the peer's on a point-to-point link, and the address
    itself where there is no IFA_LOCAL, as for IPv6); loopback, IPv6 link-local (every
    interface has one: no identity), multicast and addresses whose duplicate address
    detection failed are nobody's."""
    if len(payload) < IFADDRMSG.size:
        return None, False
    _, _, flags, _, _ = IFADDRMSG.unpack_from(payload)
    attrs = attributes(payload, IFADDRMSG.size)
    ip = address(attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS))
    if ip is None:
        return None, False
    if IFA_FLAGS in attrs and len(attrs[IFA_FLAGS]) >= 4:
        flags = U32.unpack_from(attrs[IFA_FLAGS])[0]
    parsed = ipaddress.ip_address(ip)
    usable = not (parsed.is_loopback or parsed.is_multicast or parsed.is_unspecified
                  or (parsed.version == 6 and parsed.is_link_local)
                  or flags & IFA_F_DADFAILED)
    return ip, usable


def nsid_of(payload: bytes) -> int | None:
    """The NETNSA_NSID of an RTM_NEWNSID/DELNSID/GETNSID answer."""
    raw = attributes(payload, RTGENMSG.size).get(NETNSA_NSID)
    return S32.unpack_from(raw)[0] if raw is not None and len(raw) >= 4 else None


def subscribe(rcvbuf: int) -> socket.socket:
    """A non-blocking socket that receives the address and nsid notifications of this
    network namespace and, through NETLINK_LISTEN_ALL_NSID (CAP_NET_BROADCAST), of every
    namespace that has an nsid here, each tagged with it.  OSError if the kernel refuses."""
    events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK
                           | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE)
    try:
        try:   # SO_RCVBUFFORCE needs CAP_NET_ADMIN; without it rmem_max caps the size
            events.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
        except OSError:
            events.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        events.bind((0, GROUPS))
        events.setsockopt(SOL_NETLINK, NETLINK_LISTEN_ALL_NSID, 1)
    except OSError:
        events.close()
        raise
    return events


def receive(events: socket.socket) -> tuple[bytes, int | None]:
    """One datagram and the nsid it came from (None: this namespace).  BlockingIOError when
    there is none; OSError(ENOBUFS) when notifications were lost."""
    data, ancillary, _, _ = events.recvmsg(1 << 16, socket.CMSG_SPACE(4))
    for level, kind, value in ancillary:
        if level == SOL_NETLINK and kind == NETLINK_LISTEN_ALL_NSID and len(value) >= 4:
            return data, S32.unpack_from(value)[0]
    return data, None


class Requests:
    """A socket for requests to the kernel, one at a time.  `OSError` from the socket or the
    kernel goes to the caller."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                   socket.NETLINK_ROUTE)
        try:
            self._sock.settimeout(2.0)
            self._sock.bind((0, 0))
            # the target-namespace address dump needs strict checking (Linux >= 4.20)
            self._sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
        except OSError:
            self._sock.close()
            raise
        self._seq = 0
        self.done = 0          # requests answered

    def close(self) -> None:
        self._sock.close()

    def nsid(self, netns_fd: int) -> int:
        """The nsid the namespace behind ``netns_fd`` has here (NSID_NOT_ASSIGNED: none)."""
        body = RTGENMSG.pack(socket.AF_UNSPEC) + attribute(NETNSA_FD, U32.pack(netns_fd))
        for payload in self._ask(RTM_GETNSID, 0, body):
            found = nsid_of(payload)
            if found is not None:
                return found
        return NSID_NOT_ASSIGNED

    def assign_nsid(self, netns_fd: int) -> None:
        """Have the kernel give the namespace behind ``netns_fd`` an nsid here (as ``ip netns
        set NAME auto``): its notifications then reach the watch.  CAP_NET_ADMIN."""
        body = (RTGENMSG.pack(socket.AF_UNSPEC) + attribute(NETNSA_FD, U32.pack(netns_fd))
                + attribute(NETNSA_NSID, S32.pack(NSID_NOT_ASSIGNED)))
        try:
            self._ask(RTM_NEWNSID, NLM_F_ACK, body)
        except OSError as exc:
            if exc.errno != errno.EEXIST:   # given one meanwhile: as good
                raise

    def nsids(self) -> list[int] | None:
        """Every nsid assigned here (None: the dump kept changing)."""
        payloads = self._consistent(RTM_GETNSID, RTGENMSG.pack(socket.AF_UNSPEC))
        if payloads is None:
            return None
        return [n for n in map(nsid_of, payloads) if n is not None]

    def addresses(self, nsid: int | None) -> list[bytes] | None:
        """The RTM_NEWADDR payloads of every address in namespace ``nsid`` (None: this one),
        or None when the dump kept changing.  CAP_NET_ADMIN over that namespace."""
        body = IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        if nsid is not None:
            body += attribute(IFA_TARGET_NETNSID, S32.pack(nsid))
        return self._consistent(RTM_GETADDR, body)

    def _consistent(self, kind: int, body: bytes) -> list[bytes] | None:
        for _ in range(DUMP_TRIES):
            payloads = self._ask(kind, NLM_F_DUMP, body)
            if payloads is not None:
                return payloads
        return None

    def _ask(self, kind: int, flags: int, body: bytes) -> list[bytes] | None:
        """The answer's payloads (a dump's to its end), or None if a dump was interrupted."""
        self._seq += 1
        seq = self._seq
        self._sock.send(NLMSGHDR.pack(NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | flags,
                                      seq, 0) + body)
        out: list[bytes] = []
        interrupted = False
        dump = bool(flags & NLM_F_DUMP)
        while True:
            buf = self._sock.recv(1 << 20)
            for mkind, mflags, mseq, payload in messages(buf):
                if mseq != seq:
                    continue            # the rest of an earlier request that failed half-way
                if mflags & NLM_F_DUMP_INTR:
                    interrupted = True
                if mkind == NLMSG_DONE:
                    self.done += 1
                    return None if interrupted else out
                if mkind == NLMSG_ERROR:
                    code = -S32.unpack_from(payload)[0]
                    if code:
                        raise OSError(code, f"rtnetlink: {os.strerror(code)}")
                    self.done += 1
                    return out          # an ACK
                out.append(payload)
                if not dump:
                    self.done += 1
                    return out
