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
  as the OCI archive ``ctr images import`` takes; :func:`chart_node` a :class:`ChartNode`
  with it imported.
* what the chart modules share about the user's side: :func:`values_file` (a kube2iam
  user's values plus the node's particulars), :func:`ready_agent_pod`,
  :func:`removal_commands` (docs/install.md's, for what an uninstall leaves on a node).

* :func:`pod_network_api`: the chart's API server for pods (a webhook's in-cluster client),
  on the node's address inside the node's network namespace.

All of it listens on loopback only, or inside the node's namespace.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kube
import yaml
from kubelet_node import KubeletNode
from needs import missing_tool
from tcp_proxy import TcpProxy

from e2e_cluster import BASE_ARN
from netns import call_in_netns
from runtime_node import wait_until

HELM_VERSION = "v3.19.5"   # tests/tools/build_helm.sh
IMAGE_BUILD = kube.REPO / "deploy" / "image" / "build.sh"
CHART = kube.REPO / "deploy" / "chart" / "kiamfast"
INSTALL_DOC = kube.REPO / "docs" / "install.md"              # removal_commands
SWITCH_DOC = kube.REPO / "docs" / "switching-from-kube2iam.md"   # the documented switch
IMAGE_REPO = "localhost/kiamfast/kiamfast"
NAMESPACE = "kube-system"   # where the tests install the chart
HOST_STATE_DIR = "/run/kiamfast"   # the chart's stateDir default
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

    def __init__(self, cluster: kube.Cluster, directory: Path, *,
                 controllers: tuple[str, ...] = CONTROLLERS,
                 apiserver_args: tuple[str, ...] = (),
                 server_ips: tuple[str, ...] = ()) -> None:
        """``controllers``: kube-controller-manager's ``--controllers``; ``apiserver_args``:
        more flags of the API server; ``server_ips``: addresses besides 127.0.0.1 its
        serving certificate names (see :meth:`_serving_pki`)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.processes: list[kube.Process] = []
        pki = self._serving_pki(cluster, server_ips) if server_ips else cluster.pki
        self.apiserver = kube.ApiServer(
            directory=directory, etcd=cluster.etcd, pki=pki,
            admin_token=cluster.admin.token, name="kube-apiserver-chart",
            service_account_admission=True, extra_args=apiserver_args)
        self.processes.append(self.apiserver.process)
        try:
            self.apiserver.wait_ready(60)
            self.kubeconfig = kube.write_kubeconfig(
                directory / "admin.kubeconfig", server=self.apiserver.url,
                ca=self.apiserver.ca, token=cluster.admin.token)
            self._start("kube-controller-manager", [
                f"--controllers={','.join(controllers)}",
                f"--root-ca-file={pki['ca']}",
                "--use-service-account-credentials=false"])
            self._start("kube-scheduler", [])
        except BaseException:
            self.stop()
            raise

    def _serving_pki(self, cluster: kube.Cluster, server_ips: tuple[str, ...]
                     ) -> dict[str, Path]:
        """The session's keys with a serving certificate of this server's own that also
        names ``server_ips`` (the session's names 127.0.0.1 alone), from a CA of its own; the
        CA file is both CAs, so the admin client and every pod's ``ca.crt`` (the
        ``kube-root-ca.crt`` ConfigMap, from ``--root-ca-file``) trust either server."""
        own = kube.make_pki(self.dir / "pki", server_ips=server_ips)
        bundle = self.dir / "ca-bundle.crt"
        bundle.write_bytes(cluster.pki["ca"].read_bytes() + own["ca"].read_bytes())
        return {**cluster.pki, "ca": bundle, "cert": own["cert"], "key": own["key"]}

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

    @property
    def admin(self) -> kube.Client:
        """The test's admin identity at this server (its admission, its webhooks)."""
        return self.apiserver.admin

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
    image_archive: Path | None = None   # the OCI archive of the image imported as IMAGE_REPO

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
            # The chart's container (kube2iam's name after a switch, or kube2iam's own pod).
            lines = self.kubelet.container_log(meta["namespace"], meta["name"], meta["uid"],
                                               container=pod["spec"]["containers"][0]["name"])
            text.append(f"--- {meta['name']}:\n" + "\n".join(lines[-80:]))
        return "\n".join(text)

    def failure_report(self) -> list[tuple[str, str]]:
        return [*super().failure_report(), ("agent pods' logs", self.agent_logs())]

    def labelled_metric(self, name: str, **labels: str) -> float:
        """The agent's /metrics sample ``name{labels}`` (exactly those labels); 0 if absent,
        as a counter that never counted."""
        _, body = self.http("GET", "/metrics", timeout=5.0)
        wanted = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
        for line in body.decode().splitlines():
            sample, _, value = line.rpartition(" ")
            if sample == name + wanted:
                return float(value)
        return 0.0


@contextlib.contextmanager
def chart_node(cluster: kube.Cluster, directory: Path, **node_args: Any) -> Iterator[ChartNode]:
    """A :class:`ChartNode` (``node_args`` as :class:`KubeletNode` takes them) with the
    image of this checkout imported as ``IMAGE_REPO:test``; closed on exit."""
    archive = built_image(f"{IMAGE_REPO}:test")
    node = ChartNode(directory, cluster, **node_args)
    node.agent_namespace = NAMESPACE
    node.image_archive = archive
    try:
        node.containerd.import_image(archive)
        yield node
    finally:
        node.close()


def print_failure_report(node: ChartNode, control: ChartControlPlane) -> None:
    """The node's logs (kubelet, containerd, agent pods) and the controllers'."""
    for title, text in [*node.failure_report(), *control.logs()]:
        sys.stdout.write(f"\n===== {title} =====\n{text}\n")


class PodNetworkRoute:
    """``with PodNetworkRoute(node):`` the host's network namespace, where the API servers
    run, reaches the node's pods, as a real control plane does (a webhook's pod, say): a
    veth pair from the host into the node's namespace (``HOST``/30 and ``NODE``/30),
    forwarding on in the node's namespace, and a host route for the pods' subnet via the
    node's end. The one change the tests make to the host's own network, so on leaving the
    pair goes, and the route with it (also when the node's namespace is deleted: a veth
    pair dies with either end)."""

    HOST, NODE = "10.79.255.1", "10.79.255.2"

    def __init__(self, node: ChartNode) -> None:
        self.node = node
        self.link = f"kfcp{secrets.token_hex(3)}"   # host end; the node's end adds "n"

    def __enter__(self) -> "PodNetworkRoute":
        ns, peer = self.node.net.ns, f"{self.link}n"
        self._ip("link", "add", self.link, "type", "veth", "peer", "name", peer, "netns",
                 ns.name)
        try:
            self._ip("addr", "add", f"{self.HOST}/30", "dev", self.link)
            self._ip("link", "set", self.link, "up")
            for argv in (["ip", "addr", "add", f"{self.NODE}/30", "dev", peer],
                         ["ip", "link", "set", peer, "up"],
                         ["sysctl", "-qw", "net.ipv4.ip_forward=1"]):
                ns.run(argv, check=True)
            self._ip("route", "add", str(self.node.containerd.subnet), "via", self.NODE,
                     "dev", self.link)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.link], capture_output=True, timeout=20)

    @staticmethod
    def _ip(*argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=20)


def pod_network_api(node: ChartNode, control: ChartControlPlane) -> TcpProxy:
    """A :class:`TcpProxy` to ``control``'s API server listening on the node's address
    (the pods' bridge, which they route to): the API server as a pod reaches it where no
    kube-proxy serves the ``kubernetes`` Service, for a chart value's
    ``KUBERNETES_SERVICE_HOST``/``_PORT``. ``control`` must name that address in its
    certificate (``server_ips``). The caller closes it."""
    listener = call_in_netns(node.net.ns, lambda: socket.create_server((node.host_ip, 0)))
    return TcpProxy(target_port=control.apiserver.port, listener=listener)


# ---- the user's side -------------------------------------------------------------------

def state_dir(node: ChartNode) -> Path:
    """The node directory the values give as ``stateDir``."""
    return node.workdir / "kiamfast-state"


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s keys set, nested dicts merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            value = deep_merge(out[key], value)
        out[key] = value
    return out


def values_file(node: ChartNode, extra: dict[str, Any] | None = None) -> Path:
    """A kube2iam user's values (kube2iam's chart's names) plus this node's particulars,
    with ``extra`` merged in."""
    assert node.api_proxy is not None
    values = {
        "extraArgs": {"base-role-arn": BASE_ARN, "sts-endpoint": node.sts.endpoint},
        "host": {"iptables": True, "interface": node.host_interface},
        "aws": {"access_key": "testing", "secret_key": "testing", "region": "us-east-1"},
        "image": {"repository": IMAGE_REPO, "tag": "test", "pullPolicy": "Never"},
        "extraEnv": {"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                     "KUBERNETES_SERVICE_PORT": str(node.api_proxy.port)},
        # kiamfast's own values
        "cri": {"socketPath": str(node.containerd.socket)},
        "stateDir": str(state_dir(node)),
    }
    path = node.workdir / "values.yaml"
    path.write_text(yaml.safe_dump(deep_merge(values, extra or {})))
    return path


def ready(pod: dict[str, Any]) -> bool:
    """The pod is Ready and not being deleted."""
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return conditions.get("Ready") == "True" and "deletionTimestamp" not in pod["metadata"]


def ready_agent_pod(node: ChartNode, *, image: str | None = None,
                    timeout: float = 180.0) -> dict[str, Any]:
    """The node's agent pod once it is Ready (and runs ``image``, if given)."""
    def found() -> dict[str, Any] | None:
        for pod in node.agent_pods():
            if ready(pod) and image in (None, pod["spec"]["containers"][0]["image"]):
                return pod
        return None
    return wait_until(found, timeout=timeout, interval=0.5, what="the agent pod Ready")


def metadata_dnat(node: ChartNode) -> list[str]:
    return [r for r in node.dnat_rules() if "169.254.169.254" in r]


def kiamfast_rules(node: ChartNode) -> list[str]:
    """Every rule of kiamfast's on the node: the metadata DNAT rules (nat) and the backstop
    (filter), in either iptables backend."""
    backstop = [line for line in node.net.ns.iptables_save("filter").splitlines()
                if "kiamfast: metadata" in line]
    return metadata_dnat(node) + backstop


class RuleWatch:
    """``with RuleWatch(node) as rules:`` polls the node's kiamfast rules every ``interval``
    on a thread: ``rules.missing`` is every moment none was there (a pod's metadata call then
    reaches the node's service: neither redirected nor rejected), ``rules.last_present``
    the last moment one was (``time.monotonic``)."""

    def __init__(self, node: ChartNode, interval: float = 0.1) -> None:
        self.node = node
        self.interval = interval
        self.missing: list[float] = []
        self.last_present: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rule-watch", daemon=True)

    def __enter__(self) -> "RuleWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            at = time.monotonic()
            if kiamfast_rules(self.node):
                self.last_present = at
            else:
                self.missing.append(at)
            self._stop.wait(self.interval)


def removal_commands(directory: Path) -> list[str]:
    """docs/install.md's commands for what an uninstall leaves on a node, each ``sh``
    block of its section in order (the DNAT rule and the state directory first, with this
    node's state directory for the chart's default; then the container-credentials link)."""
    section = INSTALL_DOC.read_text().split("## Uninstalling", 1)[1].split("\n## ", 1)[0]
    blocks = [part.split("```", 1)[0] for part in section.split("```sh\n")[1:]]
    assert blocks and HOST_STATE_DIR in blocks[0], section
    return [block.replace(HOST_STATE_DIR, str(directory)) for block in blocks]
