"""A node and its pods built from Linux network namespaces, for end-to-end tests.

kiamfast identifies a pod by the TCP source address of its request to 169.254.169.254, after
an iptables DNAT rule on the node has sent that request to the agent. None of this can be
tested on loopback alone: the rule matches on the interface pods' traffic arrives on, and
the address the agent sees must be the pod's own. So this module builds, as root, the
smallest honest copy of a Kubernetes node:

* a **node** namespace ``kf-node-<pid>-<random>``: loopback up, ``169.254.169.254/32`` on
  the loopback (where a fake metadata service listens, as the real one "listens" on an EC2
  host), and a Linux bridge ``kfbr0`` carrying the node's host IP (``10.77.0.1/24``), the
  way ``cni0``/``docker0`` carry it on a real node;
* **pods**: one namespace each, joined to the bridge by a veth pair, with a pod IP in the
  bridge's subnet and a default route via the node. A pod IP can be reused: delete the pod
  namespace and create another with the same address.

Namespace names carry the test process' pid and a random part, so parallel runs never
collide, and names left behind by a killed run can be recognised and freed. The bridge and
the veth ends live *inside* the node namespace (the pod end inside the pod namespace), so
nothing is ever created in, or changed about, the namespace the tests run in. The node has
no uplink: a packet that is not for the node or one of its pods goes nowhere, and the real
169.254.169.254 of the machine is never reachable from here.

In-process servers (the API server emulator, STS, the fake metadata service) are placed
inside a namespace with :func:`call_in_netns`: a short-lived thread switches its own network
namespace (``setns`` changes only the calling thread's), creates the listening sockets and
the server threads there, and exits. Sockets stay in the namespace they were created in, and
threads started from that thread inherit it, so the servers serve the node while the test
process itself never leaves its own namespace. :class:`NetnsThread` does the same for a
long-running client loop (a pod that keeps asking for credentials).

This module must never touch an address, route, rule or link of the namespace it runs in,
and never kill a process that is not running inside one of the namespaces it created.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = [
    "BRIDGE",
    "METADATA_IP",
    "HarnessUnavailable",
    "NetnsError",
    "Netns",
    "NetnsThread",
    "NodeNet",
    "PodNet",
    "call_in_netns",
    "remove_stale_namespaces",
    "unavailable_reason",
]

T = TypeVar("T")

METADATA_IP = "169.254.169.254"
BRIDGE = "kfbr0"
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)


class HarnessUnavailable(Exception):
    """This machine cannot build namespaces (not root, a tool missing); tests skip."""


class NetnsError(RuntimeError):
    """A namespace, link or address could not be created or removed."""


def unavailable_reason() -> str | None:
    """Why the harness cannot run here, or None. Checked once per session by conftest."""
    from needs import missing_tool, not_root_reason
    reason = (not_root_reason("network namespaces, veth, iptables")
              or missing_tool("ip", "iptables"))
    if reason:
        return f"end-to-end tests: {reason}"
    probe = f"kf-probe-{os.getpid()}-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


_STALE = re.compile(r"^kf-(?:node|pod|probe)-(\d+)-[0-9a-f]+$")


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces a killed test run left behind (the pid in their name is gone),
    with whatever that run had started inside them (an agent outlives a SIGKILLed pytest).
    A live run's namespaces are never touched."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    removed = []
    for line in listed.splitlines():
        name = line.split(" ", 1)[0]
        m = _STALE.match(name)
        if m is None or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        try:
            Netns(name).delete()
        except NetnsError:
            continue
        removed.append(name)
    return removed


def _ip(*args: str, netns: str | None = None) -> str:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns: {os.strerror(err)}")


def call_in_netns(netns: "Netns", fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` in a fresh thread that lives in ``netns``; return its result or raise.

    Sockets ``fn`` creates, and threads it starts, belong to ``netns``. The calling thread's
    own namespace is never changed.
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(netns.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=body, name=f"in-{netns.name}", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class NetnsThread(threading.Thread):
    """A daemon thread whose whole life runs inside ``netns`` (its ``target`` included)."""

    def __init__(self, netns: "Netns", target: Callable[[], None], *, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.netns = netns
        self._body = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            fd = os.open(self.netns.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            self._body()
        except BaseException as exc:  # noqa: BLE001 - reported by whoever joins
            self.error = exc


class Netns:
    """One named network namespace (``ip netns``), with loopback up."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = os.path.join(NETNS_DIR, name)
        self.deleted = False

    @classmethod
    def create(cls, prefix: str) -> "Netns":
        """``<prefix>-<pid>-<random>``: unique per run, and the pid tells
        :func:`remove_stale_namespaces` whether the run that made it is still alive."""
        ns = cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}")
        _ip("netns", "add", ns.name)
        try:
            _ip("link", "set", "lo", "up", netns=ns.name)
        except BaseException:
            ns.delete()
            raise
        return ns

    def __repr__(self) -> str:
        return f"Netns({self.name!r})"

    @property
    def inode(self) -> int | None:
        try:
            return os.stat(self.path).st_ino
        except FileNotFoundError:
            return None

    # -- running things inside -----------------------------------------------------------

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so it runs in this namespace (``ip netns exec`` execs, so the
        process keeps the pid ``Popen`` reports)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float = 30.0, cwd: str | None = None,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.argv(argv), env=dict(env) if env is not None else None,
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} in {self.name} exited {proc.returncode}: "
                             f"{proc.stderr.strip()}")
        return proc

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | None = None, stdout: Any = None, stderr: Any = None,
              stdin: Any = subprocess.DEVNULL) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), env=dict(env) if env is not None else None,
                                cwd=cwd, stdout=stdout, stderr=stderr, stdin=stdin,
                                start_new_session=True)

    def iptables_save(self, table: str = "nat") -> str:
        """The rules of ``table`` in both backends (the agent picks one of them)."""
        tools = [t for t in ("iptables-nft-save", "iptables-legacy-save") if shutil.which(t)]
        if len(tools) < 2:
            tools = ["iptables-save"]
        return "\n".join(self.run([tool, "-t", table], timeout=15).stdout for tool in tools)

    # -- processes -----------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Processes (other than this one) whose network namespace is this namespace."""
        ino = self.inode
        if ino is None:
            return []
        mine = os.getpid()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == mine:
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def kill_all(self) -> None:
        """SIGKILL whatever still runs inside this namespace (all of it started by tests)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def delete(self) -> None:
        if self.deleted:
            return
        self.kill_all()
        proc = subprocess.run(["ip", "netns", "del", self.name], capture_output=True,
                              text=True, timeout=20)
        if proc.returncode != 0 and os.path.exists(self.path):
            raise NetnsError(f"ip netns del {self.name}: {proc.stderr.strip()}")
        self.deleted = True


class PodNet:
    """A pod's network: its namespace, its IP, and the veth end on the node's bridge."""

    def __init__(self, ns: Netns, ip: str, node_end: str) -> None:
        self.ns = ns
        self.ip = ip
        self.node_end = node_end

    def __repr__(self) -> str:
        return f"PodNet({self.ns.name!r}, {self.ip})"


class NodeNet:
    """The node namespace: fake metadata address on loopback, the bridge, its pods.

    ``host_ip``/``prefix`` are the bridge's address; pods get addresses from that subnet.
    Namespaces isolate the addresses, so every node of every run can use the same subnet.
    """

    def __init__(self, *, host_ip: str = "10.77.0.1", prefix: int = 24) -> None:
        self.host_ip = host_ip
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(f"{host_ip}/{prefix}", strict=False)
        self.ns = Netns.create("kf-node")
        self.pods: list[PodNet] = []
        self._veth_seq = 0
        try:
            _ip("addr", "add", f"{METADATA_IP}/32", "dev", "lo", netns=self.ns.name)
            # A bridge without an address of its own takes the lowest MAC of its ports and
            # changes it when a pod is plugged in; pods that cached the old one would lose
            # the node for up to half a minute. Pin it, as CNI bridge plugins do.
            _ip("link", "add", BRIDGE, "address", "02:6b:66:00:00:01", "type", "bridge",
                netns=self.ns.name)
            _ip("addr", "add", f"{host_ip}/{prefix}", "dev", BRIDGE, netns=self.ns.name)
            _ip("link", "set", BRIDGE, "up", netns=self.ns.name)
        except BaseException:
            self.ns.delete()
            raise

    @property
    def name(self) -> str:
        return self.ns.name

    def add_pod(self, ip: str) -> PodNet:
        """A new pod namespace with ``ip`` on its ``eth0``, bridged to the node."""
        if ipaddress.ip_address(ip) not in self.subnet or ip == self.host_ip:
            raise ValueError(f"{ip} is not a pod address in {self.subnet}")
        if any(p.ip == ip for p in self.pods):
            raise ValueError(f"{ip} is still in use by a live pod namespace")
        pod_ns = Netns.create("kf-pod")
        self._veth_seq += 1
        node_end = f"kfv{self._veth_seq}"
        try:
            _ip("link", "add", node_end, "type", "veth", "peer", "name", "eth0",
                "netns", pod_ns.name, netns=self.ns.name)
            _ip("link", "set", node_end, "master", BRIDGE, "up", netns=self.ns.name)
            _ip("addr", "add", f"{ip}/{self.prefix}", "dev", "eth0", netns=pod_ns.name)
            _ip("link", "set", "eth0", "up", netns=pod_ns.name)
            _ip("route", "add", "default", "via", self.host_ip, netns=pod_ns.name)
        except BaseException:
            pod_ns.delete()
            raise
        pod = PodNet(pod_ns, ip, node_end)
        self.pods.append(pod)
        self._wait_bridge_forwarding(node_end)
        return pod

    def _wait_bridge_forwarding(self, port: str, timeout: float = 5.0) -> None:
        # A new bridge port goes through the STP states unless STP is off (it is by default,
        # so the port forwards at once); wait for "forwarding" to be safe on any kernel.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = _ip("-d", "link", "show", port, netns=self.ns.name)
            if "state forwarding" in out or "bridge_slave" not in out:
                return
            time.sleep(0.02)

    def remove_pod(self, pod: PodNet) -> None:
        """Delete the pod namespace (its veth pair goes with it); its IP is free again."""
        if pod in self.pods:
            self.pods.remove(pod)
        # A deleted namespace is torn down asynchronously: until then its veth would stay on
        # the bridge with the old pod still answering for the IP. Unplug it first (deleting
        # one end removes the pair at once), as a CNI's DEL does.
        subprocess.run(["ip", "-n", self.ns.name, "link", "del", pod.node_end],
                       capture_output=True, timeout=20)
        pod.ns.delete()
        # The node's ARP entry still names the old pod's MAC, and Linux ignores a new MAC for
        # an entry confirmed within the last second (neigh locktime).
        subprocess.run(["ip", "-n", self.ns.name, "neigh", "flush", "to", pod.ip],
                       capture_output=True, timeout=20)

    def destroy(self) -> None:
        """Delete every pod namespace and the node namespace; collect errors, raise last."""
        errors: list[BaseException] = []
        for pod in list(self.pods):
            try:
                self.remove_pod(pod)
            except BaseException as exc:  # noqa: BLE001 - keep cleaning up
                errors.append(exc)
        try:
            self.ns.delete()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        if errors:
            raise errors[-1]

    def dnat_rules(self) -> list[str]:
        """Lines of the node's nat table that DNAT the metadata address (any backend)."""
        return [line for line in self.ns.iptables_save("nat").splitlines()
                if "DNAT" in line and METADATA_IP in line]
