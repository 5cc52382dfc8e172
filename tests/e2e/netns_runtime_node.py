"""A node whose pods are sandboxes of the runtime on real network namespaces that stops them
in containerd's or CRI-O's order (kiamfast/testing/netns_runtime.py).

Each pod is a network namespace with a veth to the node (its host end ``kfp…``, a /32 route
to the pod's address on it, as the CNI ``ptp`` plugin, Calico and the AWS VPC CNI route a
pod), and a sandbox of the CRI double naming that namespace in its verbose status.  The
agent gets ``--cri-endpoint`` of that double and ``--host-interface=kfp+``, so the DNAT rule
catches the pods' traffic to 169.254.169.254.  What a test does to a pod is what a runtime
does: :meth:`NetnsRuntimeNode.stop` (in the node's order; ``finish=False`` leaves a CRI-O
stop half done, its sandbox READY), :meth:`NetnsRuntimeNode.finish_stop`, the runtime's
socket going away (:meth:`NetnsRuntimeNode.break_link`), a status that keeps failing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from e2e_cluster import ROLE_KEY, Node, Pod
from netns import PodNet
from runtime_node import SandboxNetns

from kiamfast.testing.netns_runtime import NetnsRuntime, NetnsSandbox


class RuntimePod(Pod):
    """A pod whose network namespace is its sandbox's."""

    def __init__(self, node: "NetnsRuntimeNode", sandbox: NetnsSandbox, *,
                 role: str | None) -> None:
        super().__init__(node, PodNet(SandboxNetns(sandbox), sandbox.ip, ""),
                         name=sandbox.cri.name, namespace=sandbox.cri.namespace, role=role)
        self.sandbox = sandbox

    @property
    def uid(self) -> str:
        return self.sandbox.cri.uid


class NetnsRuntimeNode(Node):
    host_interface = "kfp+"

    def __init__(self, workdir: Path, *, order: str, taint: bool = False) -> None:
        self.runtime: NetnsRuntime | None = None
        super().__init__(workdir, taint=taint)
        try:
            self.runtime = NetnsRuntime(self.net.name, order=order,
                                        socket_path=str(self.workdir / "cri.sock")).start()
        except BaseException:
            self.close()
            raise

    @property
    def netns_runtime(self) -> NetnsRuntime:
        assert self.runtime is not None
        return self.runtime

    @property
    def cri_endpoint(self) -> str:   # type: ignore[override]
        return self.netns_runtime.endpoint

    def add_pod(self, name: str, ip: str, *, role: str | None = None,  # type: ignore[override]
                namespace: str = "default", in_api: bool = True, ip_in_api: bool = False,
                ready: bool = True, extra: Sequence[tuple[str, str]] = (),
                annotations: Mapping[str, str] | None = None) -> RuntimePod:
        """The kubelet's order: the pod in the API (Pending, no address), then its sandbox
        (CNI ADD, then READY unless ``ready=False``); ``ip_in_api`` publishes its address."""
        assert self.api is not None
        ann = dict(annotations or {})
        if role is not None:
            ann[ROLE_KEY] = role
        uid = str(uuid.uuid4())
        if in_api:
            self.api.pods.create(namespace, name, node=self.name, annotations=ann, uid=uid,
                                 phase="Pending")
        sandbox = self.netns_runtime.run_sandbox(name, uid=uid, ips=[ip], namespace=namespace,
                                                 annotations=ann, extra=extra, ready=ready)
        pod = RuntimePod(self, sandbox, role=role)
        self.pods[name] = pod
        if in_api and ip_in_api:
            self.publish_ip(pod)
        return pod

    def publish_ip(self, pod: RuntimePod) -> None:
        assert self.api is not None
        self.api.pods.set_ips(pod.namespace, pod.name, list(pod.sandbox.ips))
        self.api.pods.set_phase(pod.namespace, pod.name, "Running")

    def set_ready(self, pod: RuntimePod) -> None:
        self.netns_runtime.set_ready(pod.sandbox)

    def stop(self, pod: RuntimePod, *, finish: bool = True) -> None:
        self.netns_runtime.stop(pod.sandbox, finish=finish)

    def finish_stop(self, pod: RuntimePod) -> None:
        self.netns_runtime.finish_stop(pod.sandbox)

    def fail_status(self, pod: RuntimePod) -> None:
        """Every PodSandboxStatus of this sandbox fails (the view leaves it out)."""
        import grpc
        self.netns_runtime.cri.fault("PodSandboxStatus", error=grpc.StatusCode.UNAVAILABLE,
                                     sandbox_id=pod.sandbox.id)

    def break_link(self) -> None:
        """The agent's link to the runtime dies (its socket goes away) while the node goes
        on: sandboxes keep starting and stopping."""
        self.netns_runtime.cri.stop()

    def metric(self, name: str, labels: str = "") -> float | None:
        """One sample of the agent's /metrics (``labels``: its text between the braces)."""
        try:
            _, body = self.http("GET", "/metrics", timeout=5.0)
        except OSError:
            return None
        wanted = f"{name}{{{labels}}}" if labels else name
        for line in body.decode().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == wanted:
                return float(parts[1])
        return None

    def _stoppers(self) -> list[Callable[[], None]]:
        return [self.runtime.close] if self.runtime is not None else []
