"""The demo's emulated cluster: what a node has around the agent, on loopback, and what it
saw.

Why it exists: ``kiamfast demo`` runs on a bare laptop (no cluster, no AWS, no root), so the
node's surroundings are started here, in this process, on 127.0.0.1 and ephemeral ports,
one at a time (the demo times each):

* the Kubernetes API server emulator (:mod:`kiamfast.testing.apiserver`);
* the node's container runtime: the CRI fault double speaking the real CRI v1 gRPC protocol
  on a unix socket (:mod:`kiamfast.testing.cri_fault`); every pod the demo starts gets a
  READY sandbox there, as the kubelet would create one;
* moto's STS behind the recording proxy (:mod:`kiamfast.testing.sts`);
* a fake EC2 metadata service standing for the node's real one
  (:mod:`kiamfast.testing.fake_imds`).

They are a :class:`kiamfast.testing.loopback.LoopbackNode`, the one the tests and
benchmarks run. What STS and the metadata service recorded is how the demo proves no pod
got another identity.

What it must never do: listen anywhere but loopback, or leave a service running after
:meth:`DemoCluster.stop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiamfast.demo import scenario

__all__ = ["DemoCluster"]


class DemoCluster:
    """The API server, runtime, STS and metadata service of the demo's one node."""

    def __init__(self, *, workdir: Path) -> None:
        from kiamfast.testing.loopback import LoopbackNode

        #: The loopback harness (the agent's command line is built from its node).
        self.node = LoopbackNode(
            node=scenario.NODE, workdir=workdir, host_ip="127.0.0.1",
            # No token: the emulator speaks plain HTTP, and kubectl (client-go) sends a
            # user's credentials only over TLS, so with one the printed kubectl line would
            # get 401.  It listens on loopback, for the demo's life, with the demo's pods.
            base_role_arn=scenario.BASE_ROLE_ARN, api_token=None,
            startup_taint=scenario.STARTUP_TAINT, node_address="127.0.0.1",
            runtime_name="demo-runtime")
        self._sandboxes: dict[str, str] = {}   # pod ref -> sandbox id

    # ------------------------------------------------------------------ components

    @property
    def api(self) -> Any:
        return self.node.api

    @property
    def imds(self) -> Any:
        return self.node.imds

    @property
    def runtime(self) -> Any:
        return self.node.runtime

    @property
    def kubeconfig(self) -> str:
        return str(self.node.kubeconfig)

    @property
    def sts_url(self) -> str:
        return self.node.sts.url

    def start_apiserver(self) -> None:
        self.node.start_apiserver()

    def start_runtime(self) -> None:
        self.node.start_runtime()

    def start_sts(self) -> None:
        self.node.start_sts()

    def start_imds(self) -> None:
        self.node.start_imds()

    # ------------------------------------------------------------------ the kubelet's part

    def run_sandbox(self, pod: Any, uid: str) -> None:
        """The kubelet's RunPodSandbox for ``pod``: CNI gives it its address at once."""
        from kiamfast.testing.cri_fault import fake_sandbox

        sandbox = fake_sandbox(name=pod.name, namespace=pod.namespace, uid=uid, ip=pod.ip,
                               annotations=pod.annotations)
        self.runtime.put(sandbox)
        self._sandboxes[pod.ref] = sandbox.id

    def stop_sandbox(self, pod: Any) -> None:
        """StopPodSandbox: the pod's containers are gone and its address is free."""
        self.runtime.stop_sandbox(self._sandboxes.pop(pod.ref))

    # ------------------------------------------------------------------ what STS and IMDS saw

    def assume_role_calls(self) -> list:
        return self.node.sts.assume_role_calls() if self.node.sts else []

    def node_secret_requests(self) -> list[str]:
        """Paths of requests for the node's secrets that reached its metadata service."""
        if self.imds is None:
            return []
        bad = ("/iam/", "identity-credentials", "user-data")
        return [r.path for r in self.imds.requests
                if any(b in r.path.split("?", 1)[0] + "/" for b in bad)]

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> None:
        self.node.stop()
