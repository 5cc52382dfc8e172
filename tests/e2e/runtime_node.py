"""A node whose pods are real sandboxes of a real containerd, for end-to-end tests.

The agent learns who owns a pod address from the node's container runtime, so the tests
that matter most need the real thing: :class:`RuntimeNode` is the harness' :class:`Node`
(fake IMDS, API server emulator, STS, the agent with the DaemonSet's flags) plus a
Debian containerd (tests/cri/containerd.py) started inside the node's network namespace.
Its pods are what the kubelet would make:

* :meth:`RuntimeNode.add_pod` creates the pod object in the emulator first (scheduled,
  Pending, no address: the API is deliberately late), then a real sandbox through CRI
  ``RunPodSandbox`` with the pod's uid/name/namespace labels and its annotations, as the
  kubelet passes them. host-local hands out the address (10.88.0.0/24 and fd00:88::/64);
  the API learns it only when the test says so (:meth:`RuntimeNode.publish_ip`), and a dead
  sandbox's pod stays ``Running`` with its address until the test deletes it.
* The returned :class:`SandboxPod` is a harness :class:`Pod` whose network namespace is the
  sandbox's (``nsenter --net=<path containerd reports>``), so every client the harness
  knows (botocore, the AWS CLI, the JS SDK, the probers) runs "in the pod" unchanged.

The agent gets ``--cri-endpoint=unix://<containerd's socket>`` and ``--host-interface=<its
CNI bridge>``; the DNAT rule then catches the sandboxes' traffic to 169.254.169.254:80.
Containerd and its sandboxes go before the node's namespaces on :meth:`RuntimeNode.close`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from cri_api.v1 import api_pb2 as cri

from e2e_cluster import ROLE_KEY, Node, Pod
from netns import Netns, PodNet

# tests/cri/containerd.py, the real containerd its own tests use (also on sys.path there)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cri"))

from containerd import Containerd, SandboxInfo  # noqa: E402
from containerd import unavailable_reason as containerd_unavailable_reason  # noqa: E402

__all__ = ["RuntimeNode", "SandboxNetns", "SandboxPod", "containerd_unavailable_reason",
           "wait_until"]

T = TypeVar("T")

SANDBOX_BRIDGE_MAC = "02:6b:66:00:00:02"   # kfbr0 has ...:01


def wait_until(probe: Callable[[], T], *, timeout: float, interval: float = 0.05,
               what: str = "condition") -> T:
    """``probe()`` until it returns something truthy; that value, or AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout} s (last: {value!r})")
        time.sleep(interval)


class SandboxNetns(Netns):
    """A sandbox's network namespace in the harness' Netns shape. Containerd created it
    and removes it; processes enter it with nsenter, threads with setns (``path``)."""

    def __init__(self, sandbox: SandboxInfo) -> None:
        super().__init__(f"sandbox-{sandbox.namespace}-{sandbox.name}")
        self.path = sandbox.netns_path

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def delete(self) -> None:
        self.deleted = True   # StopPodSandbox tears it down, never the harness


class SandboxPod(Pod):
    """A pod backed by a real sandbox: its address is whatever host-local gave it."""

    def __init__(self, node: "RuntimeNode", sandbox: SandboxInfo, *, role: str | None,
                 annotations: Mapping[str, str], attempt: int = 0) -> None:
        super().__init__(node, PodNet(SandboxNetns(sandbox), sandbox.ip, ""),
                         name=sandbox.name, namespace=sandbox.namespace, role=role)
        self.sandbox = sandbox
        self.annotations = dict(annotations)   # what the kubelet copied onto the sandbox
        self.attempt = attempt

    @property
    def uid(self) -> str:
        return self.sandbox.uid

    @property
    def ips(self) -> list[str]:
        return [self.sandbox.ip, *self.sandbox.additional_ips]

    @property
    def ip6(self) -> str | None:
        return next((ip for ip in self.sandbox.additional_ips if ":" in ip), None)


class RuntimeNode(Node):
    """A :class:`Node` with a real containerd in its network namespace; pods are sandboxes."""

    def __init__(self, workdir: Path, *, taint: bool = True, host_ip: str = "10.77.0.1",
                 subnet: str = "10.88.0.0/24", subnet6: str | None = "fd00:88::/64",
                 cni: str = "bridge") -> None:
        self.runtime: Containerd | None = None
        self.cni = cni
        super().__init__(workdir, taint=taint, host_ip=host_ip)
        try:
            self.runtime = self._new_runtime(subnet=subnet, subnet6=subnet6).start()
            if cni == "bridge":
                # A bridge whose MAC was never set takes the lowest MAC of its ports, so it
                # changes when a sandbox's veth leaves; pods that cached the old one lose
                # the node for up to half a minute (netns.py pins kfbr0's for that reason).
                self.net.ns.run(["ip", "link", "set", self.runtime.bridge, "address",
                                 SANDBOX_BRIDGE_MAC], check=True)
        except BaseException:
            self.close()
            raise

    def _new_runtime(self, *, subnet: str, subnet6: str | None) -> Containerd:
        """The node's containerd, not started yet (a subclass may run it elsewhere)."""
        return Containerd(netns=self.net.name, subnet=subnet, subnet6=subnet6, cni=self.cni)

    @property
    def containerd(self) -> Containerd:
        assert self.runtime is not None
        return self.runtime

    @property
    def host_interface(self) -> str:   # type: ignore[override]
        # ptp names each pod's host end veth<random hex>
        return self.containerd.bridge if self.cni == "bridge" else "veth+"

    @property
    def cri_endpoint(self) -> str:   # type: ignore[override]
        return self.containerd.endpoint

    @property
    def gateway6(self) -> str | None:
        """The node's IPv6 address on the pods' bridge (the IPv6 DNAT target)."""
        return self.containerd.gateway6

    # -- pods ----------------------------------------------------------------------------

    def add_pod(self, name: str, *, role: str | None = None,  # type: ignore[override]
                namespace: str = "default", in_api: bool = True, ip_in_api: bool = False,
                host_network: bool = False,
                annotations: Mapping[str, str] | None = None) -> SandboxPod:
        """The kubelet's order: the pod is in the API (Pending, no address) before its
        sandbox runs; ``ip_in_api`` publishes the address at once (an established pod),
        ``in_api=False`` keeps the pod out of the API (the watch has not delivered it).
        A hostNetwork pod gets a sandbox in the node's network and the host IP in the API."""
        assert self.api is not None
        ann = dict(annotations or {})
        if role is not None:
            ann[ROLE_KEY] = role
        uid = str(uuid.uuid4())
        if in_api:
            self.api.pods.create(namespace, name, node=self.name, annotations=ann, uid=uid,
                                 phase="Pending", host_network=host_network)
        sandbox = self.containerd.run_sandbox(name, uid=uid, namespace=namespace,
                                              annotations=ann, host_network=host_network)
        if host_network:
            sandbox = dataclasses.replace(sandbox, ip=self.host_ip)
        pod = SandboxPod(self, sandbox, role=role, annotations=ann)
        self.pods[name] = pod
        if in_api and ip_in_api:
            self.publish_ip(pod)
        return pod

    def publish_ip(self, pod: SandboxPod) -> None:
        """The kubelet's next status sync reaches the API: the pod Running with its IPs."""
        assert self.api is not None
        self.api.pods.set_ips(pod.namespace, pod.name, pod.ips)
        self.api.pods.set_phase(pod.namespace, pod.name, "Running")

    def remove_sandbox(self, pod: SandboxPod) -> None:
        """Stop and remove the sandbox (its address is free again); the API is not told."""
        self.containerd.remove_sandbox(pod.sandbox.id)

    def recreate_sandbox(self, pod: SandboxPod) -> SandboxPod:
        """The kubelet replaces a pod's dead sandbox: StopPodSandbox, then the next attempt
        with the same uid and annotations (host-local gives it a new address). The API is
        not told; returns the pod as it is now."""
        self.containerd.stop_sandbox(pod.sandbox.id)
        sandbox = self.containerd.run_sandbox(pod.name, uid=pod.uid, namespace=pod.namespace,
                                              annotations=pod.annotations,
                                              attempt=pod.attempt + 1)
        reborn = SandboxPod(self, sandbox, role=pod.role, annotations=pod.annotations,
                            attempt=pod.attempt + 1)
        self.pods[pod.name] = reborn
        return reborn

    def kill_pause(self, pod: SandboxPod, *, timeout: float = 10.0) -> float:
        """SIGKILL the sandbox's pause process (the pod's sandbox died). Its network stays
        (netns mount, veth, address) until StopPodSandbox; containerd marks it NOTREADY.
        Returns time.monotonic() when containerd first reports NOTREADY."""
        os.kill(pod.sandbox.pid, signal.SIGKILL)
        wait_until(lambda: self.containerd.status(pod.sandbox.id).state == cri.SANDBOX_NOTREADY,
                   timeout=timeout, interval=0.005, what=f"{pod} NOTREADY")
        return time.monotonic()

    # -- the agent's own view ------------------------------------------------------------

    # The agent publishes these texts itself (/healthz at once on a runtime change, the
    # others every 2 s); tests poll them. Generous timeouts: the machine may be loaded.

    def healthz(self) -> dict[str, Any]:
        """The agent's /healthz body ({} when it does not answer with one)."""
        try:
            status, body = self.http("GET", "/healthz", timeout=5.0)
        except OSError:
            return {}
        return json.loads(body) if status == 200 and body.strip().startswith(b"{") else {}

    def debug_store(self) -> dict[str, Any]:
        """The agent's /debug/store (needs --debug, which the harness' agents have)."""
        status, body = self.http("GET", "/debug/store", timeout=5.0)
        assert status == 200, (status, body)
        return json.loads(body)

    def metric(self, name: str) -> float | None:
        """One unlabelled sample of the agent's /metrics, or None."""
        try:
            _, body = self.http("GET", "/metrics", timeout=5.0)
        except OSError:
            return None
        for line in body.decode().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == name:
                return float(parts[1])
        return None

    # -- teardown ------------------------------------------------------------------------

    def failure_report(self) -> list[tuple[str, str]]:
        return [*super().failure_report(), ("containerd log", self.containerd.log_tail())]

    def _stoppers(self) -> list[Callable[[], None]]:
        """Containerd and its sandboxes go after the agents, before the node's namespaces."""
        return [self.runtime.close] if self.runtime is not None else []
