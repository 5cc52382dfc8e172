"""kube2iam as the agent of an end-to-end node (tests/e2e), beside kiamfast on a node of its own.

:func:`start_agent` starts either agent on an e2e :class:`Node` (or a :class:`RuntimeNode`
with a real containerd) the way a DaemonSet would: in the node's network namespace, on the
app port, with its own DNAT rule for 169.254.169.254:80 on the pods' interface. For kube2iam
that is its own ``--iptables`` (the rule it adds is kube2iam's, not the test's). kube2iam has
no container runtime client, so it always answers from the API server alone.

kube2iam talks to the node's API server emulator with ``--api-server``/``--api-token`` (the
emulator wants a token and client-go's kubeconfig loader sends none over plain http), to the
node's STS proxy and to an EC2 that lists no regions on the node's loopback
(see kube2iam_harness), and proxies the rest to the node's fake metadata service.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "e2e")]

from e2e_cluster import APP_PORT, BASE_ARN, Node  # noqa: E402
from kube2iam_harness import MISSING, NoRegionsEc2, kube2iam_binary, kube2iam_env  # noqa: E402
from netns import METADATA_IP, call_in_netns  # noqa: E402

AGENTS = ["kiamfast", "kube2iam"]


class Kube2iamAgent:
    """The real kube2iam in ``node``'s namespace; closed with the node (it joins
    ``node.agents``)."""

    def __init__(self, node: Node, *, flags: tuple[str, ...] = ()) -> None:
        binary = kube2iam_binary()
        assert binary is not None, "kube2iam is not built: run tests/tools/build_kube2iam.sh"
        self.node = node
        self.ec2 = call_in_netns(node.net.ns, lambda: NoRegionsEc2().start())
        self.log_path = node.workdir / "kube2iam.log"
        argv = [str(binary), f"--api-server={node.api.url}", f"--api-token={node.api.token}",
                f"--node={node.name}", "--iptables=true",
                f"--host-interface={node.host_interface}", f"--host-ip={node.host_ip}",
                f"--app-port={APP_PORT}", f"--metadata-addr={METADATA_IP}",
                f"--base-role-arn={BASE_ARN}", *flags]
        env = kube2iam_env(node.workdir, sts_url=node.sts.endpoint, ec2_url=self.ec2.url,
                           imds_url=f"http://{METADATA_IP}", direct=(METADATA_IP,))
        with open(self.log_path, "ab") as log:
            self.proc = node.net.ns.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        node.agents.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 60.0) -> None:
        """kube2iam answers /healthz once its informers synced and its DNAT rule is in."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "kube2iam exited:\n" + self.log()
            try:
                if self.node.http("GET", "/healthz", timeout=1.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("kube2iam never got healthy:\n" + self.log())

    def close(self) -> None:
        """SIGTERM (kube2iam leaves its rule: the node's namespace goes with the node), then
        SIGKILL its process group if it lingers."""
        try:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
        finally:
            self.ec2.stop()

    def log(self, tail: int = 12000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except FileNotFoundError:
            return ""


def start_agent(node: Node, agent: str):
    """``agent`` ("kiamfast" or "kube2iam") on ``node``, ready."""
    if agent == "kiamfast":
        return node.start_agent()
    started = Kube2iamAgent(node)
    started.wait_ready()
    return started


def unavailable_reason(*, runtime: bool) -> str | None:
    """Why these tests cannot run here (root and namespaces; containerd if ``runtime``;
    the kube2iam binary), or None."""
    from netns import unavailable_reason as netns_reason
    reason = netns_reason()
    if reason is None and runtime:
        from runtime_node import containerd_unavailable_reason
        reason = containerd_unavailable_reason()
    if reason is None and kube2iam_binary() is None:
        reason = MISSING
    if reason is None:
        from e2e_cluster import sweep_stale_runs
        sweep_stale_runs()
    return reason


def skip_unless_available(*, runtime: bool) -> None:
    """Skip the calling test or fixture, naming what is missing (see unavailable_reason)."""
    import pytest
    reason = unavailable_reason(runtime=runtime)
    if reason:
        pytest.skip(reason)
