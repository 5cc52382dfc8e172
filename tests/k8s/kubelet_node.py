"""A whole real node: the session's kube-apiserver, a real kubelet, a real containerd, pods
whose app container is the AWS SDK for Go v2, and the agent as the DaemonSet runs it.

:class:`KubeletNode` is the end-to-end harness' :class:`RuntimeNode` (node network
namespace, fake instance metadata on 169.254.169.254, moto STS, containerd with the CNI
bridge in that namespace, the agent) with the two emulated parts made real:

* the API server is the session's real one (tests/k8s/conftest.py). The agent, inside the
  node's namespace, reaches it through a :class:`TcpProxy` whose listening socket lives in
  that namespace, with the agent's own ServiceAccount token;
* the kubelet (tests/k8s/kubelet.py) registers the node (with the startup taint unless told
  otherwise) and runs every pod the test creates through the API: sandbox, address, app
  container, status. Nothing is written on its behalf.

Each pod gets the node's name as its namespace. Its app container runs the Go client
(tests/sdk/go): the SDK's default credential chain, which ends at 169.254.169.254, then STS
GetCallerIdentity at moto; one JSON line in the container log says what it got.
"""
from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import kube
from cri_api.v1 import api_pb2 as cri
from kubelet import (APP_CONTAINER, Kubelet, MountNamespace, NodeContainerd, app_image,
                     node_mount_binds)
from kubelet import missing_reason as kubelet_missing
from tcp_proxy import TcpProxy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from e2e_cluster import ROLE_KEY, STARTUP_TAINT, Agent  # noqa: E402
from netns import call_in_netns  # noqa: E402
from netns import unavailable_reason as netns_missing  # noqa: E402
from runtime_node import RuntimeNode, wait_until  # noqa: E402
from runtime_node import containerd_unavailable_reason as containerd_missing  # noqa: E402
from sdk_clients import go_client  # noqa: E402
from sdk_clients import missing_reason as sdk_missing  # noqa: E402

__all__ = ["KubePod", "KubeletNode", "PodIpWatch", "go_time", "missing_reason",
           "wait_untainted"]


def missing_reason() -> str | None:
    """Why a KubeletNode cannot run here, or None: root and network namespaces, containerd,
    the binaries of tests/k8s/build.sh, the Go SDK client of tests/sdk."""
    return (netns_missing() or containerd_missing() or kube.missing_binaries()
            or kubelet_missing() or sdk_missing("go"))


def go_time(rfc3339: str) -> float:
    """A time the Go client printed (RFC 3339, nanoseconds), as seconds since the epoch."""
    whole, _, fraction = rfc3339.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{fraction or 0}")


@dataclass
class KubePod:
    """A pod created through the API; ``role`` is its annotation (None: none)."""
    node: "KubeletNode"
    name: str
    namespace: str
    uid: str
    role: str | None

    def __repr__(self) -> str:
        return f"pod {self.namespace}/{self.name} (role {self.role})"

    def get(self) -> dict[str, Any]:
        return self.node.admin.get_pod(self.namespace, self.name)

    def finished(self, timeout: float = 90.0) -> dict[str, Any]:
        """The pod once its app has exited (Succeeded or Failed)."""
        return wait_until(lambda: (p := self.get())["status"].get("phase") in
                          ("Succeeded", "Failed") and p, timeout=timeout, interval=0.2,
                          what=f"{self} finished")

    def _output(self) -> list[dict[str, Any]]:
        assert self.node.kubelet is not None
        return [json.loads(line) for line in self.node.kubelet.container_log(
            self.namespace, self.name, self.uid) if line.startswith("{")]

    def rounds(self) -> list[dict[str, Any]]:
        """The rounds the app has finished so far (it prints each as it ends)."""
        return [doc["round"] for doc in self._output() if "round" in doc]

    def first_round(self, timeout: float = 60.0) -> dict[str, Any]:
        return wait_until(lambda: (r := self.rounds()) and r[0], timeout=timeout,
                          interval=0.1, what=f"{self}'s first round")

    def result(self, timeout: float = 90.0) -> dict[str, Any]:
        """The Go client's summary line, once the pod finished (its exit status in
        ``exit``)."""
        pod = self.finished(timeout)
        lines = [doc for doc in self._output() if "round" not in doc]
        assert lines, f"{self}: no output; pod status {pod['status']}"
        doc = lines[-1]
        state = pod["status"]["containerStatuses"][0]["state"]
        doc["exit"] = state.get("terminated", {}).get("exitCode")
        return doc


class KubeletNode(RuntimeNode):
    """A node registered by a real kubelet with the session's real API server."""

    def __init__(self, workdir: Path, cluster: Any, *, taint: bool = True,
                 subnet: str = "10.88.0.0/24", kubelet_args: list[str] | None = None) -> None:
        """``kubelet_args``: more kubelet flags (e.g. ``--kube-api-qps=1``)."""
        self.cluster = cluster
        self.admin: kube.Client = cluster.admin
        self.api_proxy: TcpProxy | None = None
        self.kubelet: Kubelet | None = None
        # The kubelet's and containerd's mounts (created before the containerd runs in it).
        self.mount_ns: MountNamespace | None = MountNamespace(
            workdir / "kubelet", node_mount_binds(workdir / "kubelet" / "hidden"))
        super().__init__(workdir, taint=taint, subnet=subnet, subnet6=None)
        try:
            self.admin.create_namespace(self.name)
            self.image, tar = app_image(go_client())
            self.containerd.import_image(tar)
            # As docs/install.md tells users to register nodes: NoExecute, so the kubelet
            # itself refuses a pod that is bound to the node before the agent serves.
            taints = ([{"key": STARTUP_TAINT, "value": "true", "effect": "NoExecute"}]
                      if taint else [])
            assert self.api_proxy is not None
            self.kubelet = Kubelet(directory=self.workdir / "kubelet", node_name=self.name,
                                   apiserver=cluster.apiserver, containerd=self.containerd,
                                   mount_ns=self.mount_ns, netns=self.net.ns.path,
                                   node_ip=self.host_ip, api_url=self.api_proxy.url,
                                   taints=taints, extra_args=kubelet_args).start()
            self.kubelet.wait_registered()
        except BaseException:
            self.close()
            raise

    def agent(self, **kwargs: Any) -> Agent:
        """The agent in the node's mount namespace, as the DaemonSet's container is: the
        runtime's network namespace mounts show there (HostToContainer), not on the host."""
        assert self.mount_ns is not None
        wrapper = kwargs.pop("wrapper", [])
        return super().agent(wrapper=[*self.mount_ns.argv(), *wrapper], **kwargs)

    def _new_runtime(self, *, subnet: str, subnet6: str | None) -> NodeContainerd:
        runtime = NodeContainerd(netns=self.net.name, subnet=subnet, subnet6=subnet6)
        runtime.mount_ns = self.mount_ns
        return runtime

    def _start_api(self, *, taint: bool) -> None:
        listener = call_in_netns(self.net.ns, lambda: socket.create_server(("127.0.0.1", 0)))
        self.api_proxy = TcpProxy(target_port=self.cluster.apiserver.port, listener=listener)
        self.kubeconfig = self.cluster.agent_kubeconfig_via(self.api_proxy.url)

    def taints(self) -> list[str]:
        node = self.admin.get_node(self.name)
        return [t["key"] for t in node.get("spec", {}).get("taints", [])]

    # -- pods ----------------------------------------------------------------------------

    def create_pod(self, name: str, *, role: str | None = None, bind: bool = True,
                   loop: int = 1, interval: float = 1.0, refetch: bool = False,
                   annotations: dict[str, str] | None = None,
                   env: dict[str, str] | None = None,
                   service_account: str | None = None) -> KubePod:
        """A pod whose app asks for credentials first thing (``loop`` rounds, ``interval``
        apart). ``bind``: ``nodeName`` is set, so the kubelet starts it at once; otherwise it
        stays Pending until :meth:`bind` (the scheduler's part, which this cluster lacks).
        ``refetch``: the SDK's cache treats credentials as expired at once (an expiry window
        longer than their hour), so every round asks the metadata service again.
        ``service_account``: the pod's ``serviceAccountName`` (None: the namespace's
        ``default``)."""
        environment = {"AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL_STS": self.sts.moto_url,
                       **(env or {})}
        return self.create_app_pod(name, role=role, bind=bind, annotations=annotations,
                                   service_account=service_account, app={
            "image": self.image,
            "args": ["--provider", "default", "--print-rounds", "--loop", str(loop),
                     "--interval", f"{interval}s",
                     *(["--expiry-window", "2h"] if refetch else [])],
            "env": [{"name": k, "value": v} for k, v in environment.items()]})

    def create_app_pod(self, name: str, *, app: dict[str, Any], role: str | None = None,
                       bind: bool = True, annotations: dict[str, str] | None = None,
                       service_account: str | None = None) -> KubePod:
        """A pod whose one container ``app`` (image, command, args, env) prints JSON lines
        as the Go client does (:meth:`KubePod.result` reads the last one)."""
        ann = dict(annotations or {})
        if role is not None:
            ann[ROLE_KEY] = role
        spec: dict[str, Any] = {
            "restartPolicy": "Never", "automountServiceAccountToken": False,
            "enableServiceLinks": False, "terminationGracePeriodSeconds": 1,
            "containers": [{"name": APP_CONTAINER, "imagePullPolicy": "Never", **app}]}
        if bind:
            spec["nodeName"] = self.name
        if service_account is not None:
            spec["serviceAccountName"] = service_account
        pod = self.admin.call("POST", f"/api/v1/namespaces/{self.name}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": ann}, "spec": spec})
        return KubePod(node=self, name=name, namespace=self.name,
                       uid=pod["metadata"]["uid"], role=role)

    def bind(self, pod: KubePod) -> None:
        """What the scheduler does once the node may take the pod: a Binding."""
        self.admin.call("POST", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/binding",
                        {"apiVersion": "v1", "kind": "Binding",
                         "metadata": {"name": pod.name},
                         "target": {"apiVersion": "v1", "kind": "Node", "name": self.name}})

    def delete_pod(self, pod: KubePod, *, wait: float = 60.0) -> None:
        """Delete through the API and wait until the kubelet has finished it (object gone)."""
        self.admin.delete_pod(pod.namespace, pod.name, grace=1)
        wait_until(lambda: self.admin.request(
            "GET", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}")[0] == 404,
            timeout=wait, interval=0.2, what=f"{pod} gone")

    def sandbox_ip(self, pod: KubePod) -> str:
        """The address the runtime gave the pod's newest READY sandbox ("" if none)."""
        items = self.containerd.call("ListPodSandbox", cri.ListPodSandboxRequest(
            filter=cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.uid": pod.uid},
                                        state=cri.PodSandboxStateValue(
                                            state=cri.SANDBOX_READY)))).items
        if not items:
            return ""
        newest = max(items, key=lambda s: s.created_at)
        return self.containerd.status(newest.id).network.ip

    def container_started(self, pod: KubePod) -> float:
        """When the runtime started the pod's app container (wall clock, seconds)."""
        containers = self.containerd.call("ListContainers", cri.ListContainersRequest(
            filter=cri.ContainerFilter(label_selector={"io.kubernetes.pod.uid": pod.uid}))
        ).containers
        assert containers, f"{pod}: the runtime has no container"
        status = self.containerd.call("ContainerStatus", cri.ContainerStatusRequest(
            container_id=containers[0].id)).status
        return status.started_at / 1e9

    # -- teardown ------------------------------------------------------------------------

    def failure_report(self) -> list[tuple[str, str]]:
        kubelet = [("kubelet log", self.kubelet.log_tail(60))] if self.kubelet else []
        return [*super().failure_report(), *kubelet]

    def _stoppers(self) -> list[Callable[[], None]]:
        """The kubelet before its containerd; the proxy and the node's API namespace last."""
        first = [self.kubelet.stop] if self.kubelet is not None else []
        last = [self.api_proxy.close] if self.api_proxy is not None else []
        mounts = [self.mount_ns.close] if self.mount_ns is not None else []
        return [*first, *super()._stoppers(), *last, *mounts, self._delete_namespace]

    def _delete_namespace(self) -> None:
        try:
            self.admin.request("DELETE", f"/api/v1/namespaces/{self.name}")
        except Exception:  # noqa: BLE001 - the API server may be gone at session end
            pass


class PodIpWatch:
    """Watches the node's namespace through the API and notes, per pod uid, the wall-clock
    time the API first showed ``status.podIP`` (what an agent that trusts the API waits
    for). ``with PodIpWatch(node) as w: ... w.seen[uid]``. Its own connection; each watch
    lasts a second and the next resumes from the last resourceVersion, so no event is
    missed and leaving takes at most that second."""

    def __init__(self, node: KubeletNode) -> None:
        self.node = node
        self.seen: dict[str, float] = {}
        self.ips: dict[str, str] = {}
        self._client = kube.Client(url=node.admin.url, ca=node.cluster.apiserver.ca,
                                   token=node.admin.token)
        self._opened = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pod-ip-watch")

    def __enter__(self) -> "PodIpWatch":
        self._thread.start()
        if not self._opened.wait(10):
            raise RuntimeError("the pod watch did not open")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        path = f"/api/v1/namespaces/{self.node.name}/pods"
        version = self._client.call("GET", path)["metadata"]["resourceVersion"]
        self._opened.set()
        while not self._stop.is_set():
            r = self._client.http.request(
                "GET", f"{self._client.url}{path}?watch=true&timeoutSeconds=1"
                       f"&allowWatchBookmarks=true&resourceVersion={version}",
                headers={"Authorization": f"Bearer {self._client.token}"},
                preload_content=False, timeout=10.0, retries=False)
            buffer = b""
            for chunk in r.stream(4096):
                now = time.time()
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    event = json.loads(line)
                    pod = event["object"]
                    version = pod["metadata"].get("resourceVersion", version)
                    ip = pod.get("status", {}).get("podIP")
                    uid = pod["metadata"].get("uid")
                    if event["type"] != "BOOKMARK" and ip and uid not in self.seen:
                        self.seen[uid], self.ips[uid] = now, ip
            r.release_conn()


def wait_untainted(node: KubeletNode, timeout: float = 60.0) -> float:
    """Wait until the agent has removed the startup taint; returns time.monotonic() then."""
    wait_until(lambda: STARTUP_TAINT not in node.taints(), timeout=timeout, interval=0.1,
               what="startup taint removed")
    return time.monotonic()
