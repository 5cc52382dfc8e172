"""A container runtime on real network namespaces that stops a sandbox in either runtime's
order: containerd's, or CRI-O's.

CRI-O cannot be installed here (no Debian package; the Go module proxy refuses it), and its
order of a stop is the one that matters: its ``stopPodSandbox`` (server/sandbox_stop_linux.go)
runs ``networkStop`` first (CNI DEL: the veth, the route and the address are gone, the
address is back in IPAM), then stops the containers (up to their grace period, and the
kubelet retries a stop that failed), and only then ``SetStopped``: until then its status is
READY on an address the next sandbox may already hold.  containerd stops the containers,
marks the sandbox NOTREADY and only then runs CNI DEL.

So this runtime does what a CNI does, for real, in the node's network namespace: each
sandbox is a network namespace of its own (``ip netns add``) with a veth pair, its pod end
``eth0`` holding the sandbox's addresses and its host end a /32 (/128) route to each, as the
CNI ``ptp`` plugin, Calico and the AWS VPC CNI make them (the host end also holds
``gateway``, the pod's IPv4 default route, as ptp's does; IPv6 addresses get no default
route here).  Extra interfaces (``extra``: an EKS
IPv6 pod's IPv4 egress veth) are made the same way.  CRI itself is the fault double's
(`kiamfast.testing.cri_fault.CriFault`: real gRPC), whose verbose status names each
sandbox's namespace as containerd and CRI-O do.  `stop` follows ``order``; with
``finish=False`` a CRI-O stop stays half done (network gone, sandbox READY: a container that
will not stop) until `finish_stop`.  Root only; every link, namespace and file it made goes
at `close`.
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kiamfast.testing.cri_fault import CriFault, FakeSandbox, fake_sandbox

__all__ = ["NetnsRuntime", "NetnsSandbox", "ORDERS"]

NETNS_DIR = "/var/run/netns"
ORDERS = ("containerd", "crio")


def _ip(*argv: str, netns: str | None = None) -> None:
    prefix = ["-n", netns] if netns else []
    proc = subprocess.run(["ip", *prefix, *argv], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {proc.stderr.strip()}")


@dataclass
class NetnsSandbox:
    """One sandbox: its CRI entry, its namespace and the host ends of its veths."""
    cri: FakeSandbox
    netns_name: str
    ips: tuple[str, ...]                               # on eth0: CRI reports these
    extra: tuple[tuple[str, str], ...] = ()            # (interface, address) CRI does not
    host_ends: list[str] = field(default_factory=list)
    network_up: bool = False
    ready: bool = False                                # what CRI says of it

    @property
    def id(self) -> str:
        return self.cri.id

    @property
    def name(self) -> str:
        return self.cri.name

    @property
    def namespace(self) -> str:
        return self.cri.namespace

    @property
    def netns_path(self) -> str:
        return os.path.join(NETNS_DIR, self.netns_name)

    @property
    def ip(self) -> str:
        return self.ips[0]


class NetnsRuntime:
    """`start()`, `run_sandbox` / `stop` / `finish_stop` / `remove`, `close()`."""

    def __init__(self, node_netns: str, *, order: str = "crio", gateway: str = "169.254.1.1",
                 link_prefix: str = "kfp",
                 socket_path: str | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: one of {ORDERS}")
        self.node_netns = node_netns        # the name of the node's namespace (ip netns)
        self.order = order
        self.gateway = gateway
        self.link_prefix = link_prefix
        self.cri = CriFault(socket_path, runtime_name=f"netns-runtime ({order} order)")
        self.sandboxes: dict[str, NetnsSandbox] = {}
        self._links = 0

    @property
    def endpoint(self) -> str:
        return self.cri.endpoint

    def start(self) -> "NetnsRuntime":
        self.cri.start()
        return self

    def __enter__(self) -> "NetnsRuntime":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sandboxes ----------------------------------------------------------------------

    def run_sandbox(self, name: str, *, uid: str, ips: Sequence[str], namespace: str = "default",
                    annotations: Mapping[str, str] | None = None,
                    extra: Sequence[tuple[str, str]] = (), ready: bool = True) -> NetnsSandbox:
        """RunPodSandbox: the namespace, CNI ADD (``ips`` on eth0, ``extra`` on interfaces of
        their own), then READY (``ready=False``: CNI ADD done, RunPodSandbox not returned)."""
        netns_name = f"kfsb-{os.getpid()}-{secrets.token_hex(4)}"
        _ip("netns", "add", netns_name)
        cri = fake_sandbox(name=name, uid=uid, namespace=namespace, ip=ips[0],
                           additional_ips=ips[1:], annotations=annotations, ready=False,
                           netns=os.path.join(NETNS_DIR, netns_name))
        sandbox = NetnsSandbox(cri=cri, netns_name=netns_name, ips=tuple(ips),
                               extra=tuple(extra))
        self.sandboxes[sandbox.id] = sandbox
        self.cri.put(cri)
        self.network_up(sandbox)
        if ready:
            self.set_ready(sandbox)
        return sandbox

    def set_ready(self, sandbox: NetnsSandbox, ready: bool = True) -> None:
        sandbox.ready = ready
        self.cri.set_ready(sandbox.id, ready)

    def network_up(self, sandbox: NetnsSandbox) -> None:
        """CNI ADD: a veth per interface, the addresses on the pod end, host routes."""
        _ip("link", "set", "lo", "up", netns=sandbox.netns_name)
        interfaces = [("eth0", list(sandbox.ips))]
        for iface, ip in sandbox.extra:
            interfaces.append((iface, [ip]))
        for iface, addresses in interfaces:
            self._links += 1
            host_end = f"{self.link_prefix}{os.getpid() % 10000}x{self._links}"[:15]
            _ip("link", "add", host_end, "type", "veth", "peer", "name", iface, "netns",
                sandbox.netns_name, netns=self.node_netns)
            sandbox.host_ends.append(host_end)
            _ip("link", "set", host_end, "up", netns=self.node_netns)
            _ip("link", "set", iface, "up", netns=sandbox.netns_name)
            for ip in addresses:
                six = ipaddress.ip_address(ip).version == 6
                if six:
                    _ip("addr", "add", f"{ip}/128", "dev", iface, "nodad",
                        netns=sandbox.netns_name)
                    _ip("route", "add", f"{ip}/128", "dev", host_end, netns=self.node_netns)
                else:
                    _ip("addr", "add", f"{ip}/32", "dev", iface, netns=sandbox.netns_name)
                    _ip("addr", "replace", f"{self.gateway}/32", "dev", host_end,
                        netns=self.node_netns)
                    _ip("route", "add", f"{ip}/32", "dev", host_end, netns=self.node_netns)
                    _ip("route", "replace", f"{self.gateway}/32", "dev", iface,
                        netns=sandbox.netns_name)
                    _ip("route", "replace", "default", "via", self.gateway, "dev", iface,
                        netns=sandbox.netns_name)
        sandbox.network_up = True

    def network_down(self, sandbox: NetnsSandbox) -> None:
        """CNI DEL: the host ends go (a veth pair is deleted as one: the pod ends and their
        addresses go too, and the host routes with the links); the namespace stays."""
        for host_end in sandbox.host_ends:
            subprocess.run(["ip", "-n", self.node_netns, "link", "del", host_end],
                           capture_output=True, timeout=20)
        sandbox.host_ends.clear()
        sandbox.network_up = False

    def stop(self, sandbox: NetnsSandbox, *, finish: bool = True) -> None:
        """StopPodSandbox in this runtime's order (the address is free when it returns).
        CRI-O with ``finish=False``: the network is gone and the sandbox still READY."""
        if self.order == "containerd":
            self.set_ready(sandbox, False)
            self.network_down(sandbox)
            self._drop_netns(sandbox)
            return
        self.network_down(sandbox)
        if finish:
            self.finish_stop(sandbox)

    def finish_stop(self, sandbox: NetnsSandbox) -> None:
        """The rest of CRI-O's stop: containers stopped, namespaces removed, SetStopped."""
        self._drop_netns(sandbox)
        self.set_ready(sandbox, False)

    def remove(self, sandbox: NetnsSandbox) -> None:
        """RemovePodSandbox (stopping it first if it was not)."""
        if sandbox.network_up:
            self.stop(sandbox)
        elif sandbox.ready:
            self.finish_stop(sandbox)
        self._drop_netns(sandbox)
        self.cri.remove(sandbox.id)
        self.sandboxes.pop(sandbox.id, None)

    def _drop_netns(self, sandbox: NetnsSandbox) -> None:
        subprocess.run(["ip", "netns", "del", sandbox.netns_name], capture_output=True,
                       timeout=20)

    def close(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            self.network_down(sandbox)
            self._drop_netns(sandbox)
        self.sandboxes.clear()
        self.cri.close()
