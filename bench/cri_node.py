"""The node's container runtime for the runtime benchmarks (bench/churn.py with a runtime,
runtime_first_call.py, runtime_polling.py, runtime_client.py): a real containerd when root
and containerd are there, else the CRI fault double; and the pods on it, each an API object
of bench_agent's node and a sandbox of the runtime.

* :class:`FaultNode`: kiamfast/testing/cri_fault.py's CRI server (real gRPC) in this
  process; a sandbox's address is a loopback address, one per slot, so a client binds it.
* :class:`ContainerdNode`: tests/cri/containerd.py's containerd in a fresh network namespace
  standing for the node, which this thread enters (the API emulator, STS, the metadata
  service and the agent then all live on its loopback); every sandbox has its own network
  namespace with a real CNI address from a host-local range of exactly one address per
  slot, so an address just freed is the next one handed out.
* :class:`CrioOrderNode`: kiamfast/testing/netns_runtime.py's runtime on real network
  namespaces, veths and host routes, in a fresh node namespace as above, stopping sandboxes
  in CRI-O's order: a removed sandbox's network goes at once (its address is the next
  sandbox's) while the sandbox stays READY for ``ready_for`` seconds more.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import shutil
import sys
from dataclasses import dataclass

from benchutil import ROOT, pod_addresses

sys.path.insert(0, str(ROOT / "tests" / "cri"))    # containerd.py

NAMESPACE = "bench"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

# Client processes are forked while this process has gRPC channels: skip gRPC's fork
# handlers (the children never use gRPC) and their log line per fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


# ---- network namespaces ----------------------------------------------------------------------

def enter_netns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (threads it starts
    and processes it forks afterwards are born there; sockets stay where they were made)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside_netns(path: str):
    """This thread in ``path`` for the duration, then back where it was."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter_netns(path)
        try:
            yield
        finally:
            if _libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace")
    finally:
        os.close(home)


# ---- the node's runtime: a real containerd, or the fault double ------------------------------

@dataclass(frozen=True)
class Sandbox:
    id: str
    ip: str
    netns: str | None   # the sandbox's network namespace (None: a loopback address)


class FaultNode:
    """The CRI fault double; sandbox addresses are loopback addresses, one per slot."""

    kind = "CRI fault double (real gRPC, loopback addresses)"
    # bench_agent's defaults (the agent on 127.0.0.1); loopback pods have no network
    # namespace of their own for the kernel to show: READY is taken at its word
    agent_flags: list[str] = ["--address-proof=runtime"]
    agent_host = "127.0.0.1"

    def __init__(self, slots: int) -> None:
        from kiamfast.testing.cri_fault import CriFault
        self.addrs = pod_addresses(slots)
        self.cri = CriFault().start()
        self.endpoint = self.cri.endpoint

    def run_sandbox(self, slot: int, *, name: str, uid: str, annotations: dict) -> Sandbox:
        from kiamfast.testing.cri_fault import fake_sandbox
        sb = fake_sandbox(name=name, uid=uid, namespace=NAMESPACE, ip=self.addrs[slot],
                          annotations=annotations)
        self.cri.put(sb)
        return Sandbox(id=sb.id, ip=sb.ip, netns=None)

    def remove_sandbox(self, sandbox: Sandbox) -> None:
        self.cri.stop_sandbox(sandbox.id)   # NOTREADY first, as a runtime's stop is
        self.cri.remove(sandbox.id)

    def close(self) -> None:
        self.cri.close()


class ContainerdNode:
    """A real containerd in a fresh node network namespace, which this thread enters (so
    create it before any server thread starts, and close it to come back)."""

    kind = "real containerd (CNI bridge + host-local addresses, clients in the sandboxes)"

    def __init__(self, slots: int, *, subnet: str = "10.89.0.0/24") -> None:
        from containerd import Containerd, NodeNetns
        self.netns = NodeNetns()
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            enter_netns(self.netns.path)
            # generous: under a load average of 20-30 here a StopPodSandbox took over 10 s
            self.ctd = Containerd(netns=self.netns.name, subnet=subnet,
                                  call_timeout=120.0).start()
            net = ipaddress.ip_network(subnet)
            first = net.network_address + 10
            # exactly one address per slot: a freed address is the next one handed out
            self.ctd.set_range(str(first), str(first + slots - 1))
        except BaseException:
            self.close()
            raise
        self.endpoint = self.ctd.endpoint
        self.agent_host = self.ctd.gateway   # the node's address on the bridge
        self.agent_flags = ["--listen-host="]  # every address of the node namespace

    def run_sandbox(self, slot: int, *, name: str, uid: str, annotations: dict) -> Sandbox:
        info = self.ctd.run_sandbox(name, uid=uid, namespace=NAMESPACE,
                                    annotations=annotations)
        return Sandbox(id=info.id, ip=info.ip, netns=info.netns_path)

    def remove_sandbox(self, sandbox: Sandbox) -> None:
        self.ctd.remove_sandbox(sandbox.id)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "ctd", None) is not None:
                self.ctd.close()
        _libc.setns(self._home, CLONE_NEWNET)
        os.close(self._home)
        self.netns.delete()


class CrioOrderNode:
    """CRI-O's order of a stop on real network namespaces (see the module docstring)."""

    kind = ("CRI-O's stop order on real network namespaces (veths and host routes, the old "
            "sandbox READY after its address is reused, clients in the sandboxes)")

    def __init__(self, slots: int, *, subnet: str = "10.90.0.0/24",
                 ready_for: tuple[float, float] = (0.2, 1.5)) -> None:
        import random

        from containerd import NodeNetns

        from kiamfast.testing.netns_runtime import NetnsRuntime
        self.netns = NodeNetns()
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        self._rng = random.Random(7)
        self.ready_for = ready_for
        self._stopping: list[tuple[float, object]] = []    # (when READY ends, sandbox)
        self._sandboxes: dict[str, object] = {}
        try:
            enter_netns(self.netns.path)
            self.runtime = NetnsRuntime(self.netns.name, order="crio").start()
        except BaseException:
            self.close()
            raise
        first = ipaddress.ip_network(subnet).network_address + 10
        self.addrs = [str(first + i) for i in range(slots)]
        self.endpoint = self.runtime.endpoint
        self.agent_host = self.runtime.gateway   # on every pod's host end
        self.agent_flags = ["--listen-host="]

    def run_sandbox(self, slot: int, *, name: str, uid: str, annotations: dict) -> Sandbox:
        self._finish_due()
        sb = self.runtime.run_sandbox(name, uid=uid, ips=[self.addrs[slot]],
                                      namespace=NAMESPACE, annotations=annotations)
        self._sandboxes[sb.id] = sb
        return Sandbox(id=sb.id, ip=sb.ip, netns=sb.netns_path)

    def remove_sandbox(self, sandbox: Sandbox) -> None:
        """CNI DEL now (the address is free); the sandbox leaves READY only later."""
        import time
        sb = self._sandboxes.pop(sandbox.id, None)
        if sb is not None:
            self.runtime.stop(sb, finish=False)
            self._stopping.append((time.monotonic() + self._rng.uniform(*self.ready_for), sb))
        self._finish_due()

    def _finish_due(self, *, everything: bool = False) -> None:
        import time
        now = time.monotonic()
        for entry in [e for e in self._stopping if everything or e[0] <= now]:
            self._stopping.remove(entry)
            self.runtime.remove(entry[1])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "runtime", None) is not None:
                self._finish_due(everything=True)
                self.runtime.close()
        _libc.setns(self._home, CLONE_NEWNET)
        os.close(self._home)
        self.netns.delete()


def containerd_unavailable() -> str | None:
    from containerd import unavailable_reason
    return unavailable_reason() or (None if shutil.which("iptables") else
                                    "needs iptables (the DNAT in each sandbox): run "
                                    "`sh tests/cri/setup.sh`")


def make_node(kind: str, slots: int):
    """'containerd', 'crio' (CRI-O's order on real namespaces), 'fault', or 'auto'
    (containerd when it can run here)."""
    if kind == "auto":
        kind = "fault" if containerd_unavailable() else "containerd"
    if kind in ("containerd", "crio"):
        reason = containerd_unavailable()
        if reason:
            raise RuntimeError(reason)
        return ContainerdNode(slots) if kind == "containerd" else CrioOrderNode(slots)
    return FaultNode(slots)


# ---- pods: an API object and a sandbox -------------------------------------------------------

@dataclass
class Pod:
    name: str
    role: int
    sandbox: Sandbox


def new_api_pod(c, role: bytes) -> tuple[str, str]:
    """A pod scheduled on bench_agent's node ``c`` (Pending, no address yet): its name and
    UID."""
    name = c.add_pod("", role.decode(), namespace=NAMESPACE, phase="Pending")
    return name, c.api.pods.get(NAMESPACE, name)["metadata"]["uid"]


def sandbox_for(node, slot: int, *, name: str, uid: str, role: bytes) -> Sandbox:
    """The pod's sandbox, labelled and annotated as the kubelet does."""
    from kiamfast.testing.loopback import ROLE_KEY
    return node.run_sandbox(slot, name=name, uid=uid, annotations={ROLE_KEY: role.decode()})


def populate(c, node, *, role_names: list[bytes], slots: int) -> list[Pod]:
    """Every slot's first pod, known to the API (so an agent is ready with them); every
    role in use from the start, so no later pod waits on STS."""
    pods = []
    for i in range(slots):
        role = i % len(role_names)
        name, uid = new_api_pod(c, role_names[role])
        sb = sandbox_for(node, i, name=name, uid=uid, role=role_names[role])
        c.api.pods.set_ips(NAMESPACE, name, [sb.ip])
        c.api.pods.set_phase(NAMESPACE, name, "Running")
        pods.append(Pod(name=name, role=role, sandbox=sb))
    return pods


def remove_pods(node, pods: list[Pod]) -> None:
    """Every pod's sandbox gone (what is already gone, or cannot be removed on a runtime
    being closed anyway, is passed over)."""
    for pod in pods:
        with contextlib.suppress(Exception):
            node.remove_sandbox(pod.sandbox)
