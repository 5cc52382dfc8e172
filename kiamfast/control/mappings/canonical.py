"""Addresses and resource versions as the API server and the runtime spell them."""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("kiamfast.ownership")


def canonical_ip(ip: str) -> str | None:
    """The address in one spelling (IPv6 compressed, IPv4-mapped IPv6 as IPv4), or None."""
    try:
        a = ipaddress.ip_address(ip.strip())
    except ValueError:
        return None
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return str(a.ipv4_mapped)
    return a.compressed


def resource_version(obj: Mapping[str, Any]) -> int:
    """metadata.resourceVersion as an integer (etcd revisions are; 0 when absent or opaque)."""
    rv = (obj.get("metadata") or {}).get("resourceVersion") or "0"
    try:
        return int(rv)
    except (TypeError, ValueError):
        return 0


def pod_ips(obj: Mapping[str, Any]) -> tuple[str, ...]:
    """`status.podIPs` (all families), falling back to `status.podIP`; canonical, unique."""
    status = obj.get("status") or {}
    raw = [e.get("ip", "") for e in (status.get("podIPs") or []) if isinstance(e, dict)]
    if not raw and status.get("podIP"):
        raw = [status["podIP"]]
    out: list[str] = []
    for r in raw:
        c = canonical_ip(r) if r else None
        if c is None:
            if r:
                log.warning("ignoring malformed pod IP %r", r)
            continue
        if c not in out:
            out.append(c)
    return tuple(out)
