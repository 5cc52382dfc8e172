"""What a chart install needs beyond the kubelet tier: the controllers, helm, the image.

* :class:`ChartControlPlane`: a second kube-apiserver of the session's cluster (same etcd,
  same keys) with the ServiceAccount admission plugin on, so the pods created through it get
  their ServiceAccount's projected token volume as on any cluster; the real
  kube-controller-manager (the DaemonSet controller, the garbage collector that deletes a
  deleted DaemonSet's pods, the node lifecycle controller that lifts
  the kubelet's ``node.kubernetes.io/not-ready`` taint, and the publisher of the
  ``kube-root-ca.crt`` ConfigMap that the token volume projects) and the real kube-scheduler,
  both against that server. The session's own server keeps the admission plugin off (its
  tests' namespaces have no ``default`` ServiceAccount), and the controllers run only for the
  chart tests: started per module, stopped after it.
* :func:`helm`: the tests' real helm (tests/tools/build_helm.sh) against that server.
* :func:`built_image`: the image deploy/image/build.sh builds (cached under $KIAMFAST_TOOLS),
  as the OCI archive ``ctr images import`` takes.

All of it listens on loopback only.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import kube
from kubelet_node import KubeletNode
from needs import missing_tool

HELM_VERSION = "v3.19.5"   # tests/tools/build_helm.sh
IMAGE_BUILD = kube.REPO / "deploy" / "image" / "build.sh"
AGENT_CONTAINER = "kiamfast"   # the chart's container name
CONTROLLERS = ("daemonset-controller", "garbage-collector-controller",
               "node-lifecycle-controller", "root-ca-certificate-publisher-controller")


def helm_binary() -> Path:
    return kube.tools_dir() / f"helm-{HELM_VERSION}" / "helm"


def missing_reason() -> str | None:
    """Why the chart tests cannot run here, or None."""
    reason = kube.missing_binaries(("kube-controller-manager", "kube-scheduler"))
    if reason:
        return reason
    if not helm_binary().is_file():
        return f"needs helm ({helm_binary()}): run tests/tools/build_helm.sh"
    return missing_tool("buildah", "mmdebstrap", "ctr")


def built_image(name: str) -> Path:
    """The OCI archive of the image built from this checkout (deploy/image/build.sh)."""
    result = subprocess.run(["nice", "-n", "10", str(IMAGE_BUILD), name], capture_output=True,
                            text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return Path(result.stdout.splitlines()[-1])


class ChartControlPlane:
    """The session cluster's second API server with ServiceAccount admission, and the real
    controller-manager and scheduler against it; :meth:`stop` ends all three."""

    def __init__(self, cluster: kube.Cluster, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.processes: list[kube.Process] = []
        self.apiserver = kube.ApiServer(
            directory=directory, etcd=cluster.etcd, pki=cluster.pki,
            admin_token=cluster.admin.token, name="kube-apiserver-chart",
            service_account_admission=True)
        self.processes.append(self.apiserver.process)
        try:
            self.apiserver.wait_ready(60)
            self.kubeconfig = kube.write_kubeconfig(
                directory / "admin.kubeconfig", server=self.apiserver.url,
                ca=self.apiserver.ca, token=cluster.admin.token)
            self._start("kube-controller-manager", [
                f"--controllers={','.join(CONTROLLERS)}",
                f"--root-ca-file={cluster.pki['ca']}",
                "--use-service-account-credentials=false"])
            self._start("kube-scheduler", [])
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str]) -> None:
        self.processes.append(kube.Process(name=name, log_path=self.dir / f"{name}.log", argv=[
            str(kube.binary(name, kube.KUBE_VERSION)), f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1",
            f"--secure-port={kube.free_port()}", "--v=1", *args]))

    def check_alive(self) -> None:
        for process in self.processes:
            process.check_alive()

    def logs(self) -> list[tuple[str, str]]:
        return [(p.name, p.log_tail(40)) for p in self.processes]

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def helm(control: ChartControlPlane, *args: str, timeout: float = 120) -> str:
    """``helm <args>`` against the chart's API server; its stdout (fails on an error)."""
    home = control.dir / "helm"
    env = dict(os.environ, KUBECONFIG=str(control.kubeconfig),
               HELM_CACHE_HOME=str(home / "cache"), HELM_CONFIG_HOME=str(home / "config"),
               HELM_DATA_HOME=str(home / "data"))
    started = time.monotonic()
    result = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True,
                            env=env, timeout=timeout)
    assert result.returncode == 0, (f"helm {' '.join(args)} ({time.monotonic() - started:.1f}"
                                    f" s): {result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


class ChartNode(KubeletNode):
    """A :class:`KubeletNode` whose agent is the chart's DaemonSet pod in ``namespace``:
    its logs are that pod's container logs (the kubelet's files)."""

    agent_namespace = ""

    def agent_pods(self) -> list[dict[str, Any]]:
        """The agent's pods on this node, oldest first."""
        pods = self.admin.call("GET", f"/api/v1/namespaces/{self.agent_namespace}/pods"
                                      f"?fieldSelector=spec.nodeName={self.name}")["items"]
        return sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"])

    def agent_logs(self) -> str:
        assert self.kubelet is not None
        text = []
        for pod in self.agent_pods():
            meta = pod["metadata"]
            lines = self.kubelet.container_log(meta["namespace"], meta["name"], meta["uid"],
                                               container=AGENT_CONTAINER)
            text.append(f"--- {meta['name']}:\n" + "\n".join(lines[-80:]))
        return "\n".join(text)

    def failure_report(self) -> list[tuple[str, str]]:
        return [*super().failure_report(), ("agent pods' logs", self.agent_logs())]
