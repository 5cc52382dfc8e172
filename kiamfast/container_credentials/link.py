"""The container-credentials addresses on a link of the agent's own (--container-credentials-link).

Why: the SDKs accept only a few hosts in AWS_CONTAINER_CREDENTIALS_FULL_URI over http
(169.254.170.23 and [fd00:ec2::23] among them), and no node has those addresses. A pod's
packet to them leaves by its default route to the node, which delivers it to a local socket
only if the address is local. A link that carries nothing (a dummy link, as the EKS Pod
Identity Agent and kube-proxy's IPVS mode use) holding each address as /32 or /128 makes
them local without touching any real interface, route or rule.

* Idempotent: a restarted agent finds the link and its addresses and adds only what is
  missing.
* IPv6 is optional: where the node has it disabled an IPv6 address cannot be added; that
  listener is skipped with one log line and IPv4 is served. An IPv4 address that cannot be
  added (no NET_ADMIN, say) is fatal: the supervisor exits and the DaemonSet restarts it.
* Kept when the agent stops: a pod then gets a refused connection at once (the address is
  local, nothing listens), never a timeout or another host's answer; the SDKs do not fall
  back to IMDS. deploy/README.md gives the removal command.
* A kernel without dummy links (CONFIG_DUMMY off) gets a bridge without ports instead: it
  too carries no traffic and holds local addresses.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import subprocess
from collections.abc import Sequence

log = logging.getLogger("kiamfast.container_credentials.link")

FLAG = "container-credentials-link"
KINDS = ("dummy", "bridge")        # what we create, in order of preference; what we accept


class LinkError(Exception):
    """The link or an IPv4 address could not be set up; the message names the flag."""


def _ip(argv: Sequence[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        raise LinkError(f"--{FLAG}: needs iproute2's ip command") from None


def _why(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


class Link:
    def __init__(self, name: str) -> None:
        self.name = name

    def _show(self) -> dict | None:
        """The link as `ip -j -d link show` gives it, or None when it does not exist."""
        proc = _ip(["-j", "-d", "link", "show", "dev", self.name])
        if proc.returncode != 0:
            return None
        return json.loads(proc.stdout)[0]

    def ensure(self) -> None:
        """The link exists, is of a kind we make (dummy, bridge) and is up."""
        found = self._show()
        if found is None:
            self._create()
            found = self._show()
            if found is None:
                raise LinkError(f"--{FLAG}={self.name}: created but not found")
        kind = (found.get("linkinfo") or {}).get("info_kind")
        if kind not in KINDS:
            raise LinkError(f"--{FLAG}={self.name}: a {kind or 'physical'} link of that name "
                            f"exists; name a link of the agent's own")
        if "UP" not in found.get("flags", ()):
            proc = _ip(["link", "set", "dev", self.name, "up"])
            if proc.returncode != 0:
                raise LinkError(f"--{FLAG}={self.name}: cannot bring it up: {_why(proc)}")

    def _create(self) -> None:
        errors = []
        for kind in KINDS:
            proc = _ip(["link", "add", self.name, "type", kind])
            if proc.returncode == 0:
                log.info("created the link %s (%s) for the container-credentials addresses",
                         self.name, kind)
                return
            errors.append(f"{kind}: {_why(proc)}")
            if "Unknown device type" not in proc.stderr:   # no NET_ADMIN, a bad name...
                break
        raise LinkError(f"--{FLAG}={self.name}: cannot create it: {'; '.join(errors)}")

    def addresses(self) -> set[str]:
        proc = _ip(["-j", "addr", "show", "dev", self.name])
        if proc.returncode != 0:
            raise LinkError(f"--{FLAG}={self.name}: cannot list its addresses: {_why(proc)}")
        return {a["local"] for entry in json.loads(proc.stdout or "[]")
                for a in entry.get("addr_info", ()) if "local" in a}

    def add(self, host: str) -> str | None:
        """Put ``host`` on the link; None, or why it could not be added."""
        ip = ipaddress.ip_address(host)
        argv = ["addr", "add", f"{ip}/{ip.max_prefixlen}", "dev", self.name]
        if ip.version == 6:
            argv.append("nodad")   # bindable at once; no other host can have it on this link
        proc = _ip(argv)
        return None if proc.returncode == 0 else _why(proc)


def ensure_addresses(name: str, hosts: Sequence[str]) -> list[str]:
    """Make link ``name`` hold every one of ``hosts``; return the hosts it holds (an IPv6 one
    that could not be added is left out, with a log line). `LinkError` for the rest."""
    link = Link(name)
    link.ensure()
    present = {str(ipaddress.ip_address(a)) for a in link.addresses()}
    held = []
    for host in hosts:
        canonical = str(ipaddress.ip_address(host))
        if canonical in present:
            log.info("%s already holds %s", name, canonical)
            held.append(host)
            continue
        why = link.add(canonical)
        if why is None:
            log.info("added %s to %s", canonical, name)
            present.add(canonical)
            held.append(host)
        elif ipaddress.ip_address(host).version == 6:
            log.warning("not serving container credentials on [%s]: cannot add it to %s "
                        "(IPv6 disabled on the node?): %s", canonical, name, why)
        else:
            raise LinkError(f"--{FLAG}={name}: cannot add {canonical}: {why}")
    return held
