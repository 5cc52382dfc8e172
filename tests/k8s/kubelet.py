"""A real kubelet for the tests: the one built from k8s.io/kubernetes by tests/k8s/build.sh,
registered with the session's real API server and driving a real containerd.

Everything between "pod created" and "the app's first SDK call" is then the kubelet's own
timing: it syncs the pod, calls RunPodSandbox (CNI gives the address), creates and starts the
app container, and reports ``status.podIP`` on a later sync (../shared/reference/cri.md).

What this VM needs (cri.md: cgroup v1, no swap, no CAP_SYS_RESOURCE), and how the kubelet is
kept off the host's own state:

* cgroupfs driver, the pod cgroups under the containerd's own cgroup parent (created here in
  every v1 hierarchy, or in the v2 tree, which this VM does not have and where this is
  untried; the containerd's cleanup removes the whole tree), ``oomScoreAdj: 0``
  (lowering it needs CAP_SYS_RESOURCE);
* the kubelet and the node's containerd share one mount namespace of their own
  (:class:`MountNamespace`: a slave of the host's, so host mounts reach it and its own never
  leave; shared inside, so the mounts the kubelet makes for a pod's volumes reach the
  containers runc starts, and a ``HostToContainer`` volume sees the runtime's later mounts).
  There the six kernel settings the kubelet would otherwise rewrite on the host
  (vm.overcommit_memory, kernel.panic, ...) are files of this test with the values it wants,
  /var/log/containers (its log symlinks) is a directory of this test, and /run/xtables.lock
  is a file of this test (the node's iptables lock: the node is a network namespace of its
  own, its rules are no business of the host's). Projected service-account tokens, secrets,
  config maps (tmpfs mounts under the kubelet's root dir) and hostPath volumes therefore
  work; a hostPath outside the test's directories is the host's own path;
* the kubelet runs in the node's network namespace with the node's address (``--node-ip``),
  as on a real node: a hostNetwork pod's probes reach it there, and it reaches the API
  server through the node's proxy;
* root dir, pod logs, certificates, kubeconfig, config: all under one directory of the test;
  the kubelet's server and healthz listen on free loopback ports; authentication is off on
  them (nobody can call them: no anonymous, no webhook, no client CA) and the kubelet's own API identity is the
  test's admin token (the API server runs RBAC only, no Node authorizer);
* eviction thresholds near zero: a shared CI disk with little free space must not make the
  kubelet evict the test's pods.

:func:`app_image` packs the AWS SDK for Go v2 client of tests/sdk (a static binary) as an
OCI image, so a pod's app container is a real Go service asking for credentials first thing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kube

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cri"))

from containerd import NETNS_DIR, Containerd, oci_layout, tools_dir  # noqa: E402

# The kernel settings the kubelet's container manager enforces (setupKernelTunables), with
# the values it writes: they are what its private copies hold.
KERNEL_TUNABLES = {
    "vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
    "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
CGROUP_ROOT = Path("/sys/fs/cgroup")
HOST_CONTAINER_LOGS = Path("/var/log/containers")   # fixed in the kubelet's source
XTABLES_LOCK = Path("/run/xtables.lock")   # iptables' lock; the chart mounts it (hostPath)
APP_CONTAINER = "app"


def missing_reason() -> str | None:
    """Why a real kubelet cannot run here (its tests skip with this), or None."""
    reason = kube.missing_binaries(("kubelet",))
    if reason:
        return reason
    for tool in ("unshare", "nsenter", "mount", "sleep"):
        if shutil.which(tool) is None:
            return f"the kubelet tests need `{tool}` (util-linux)"
    return None


def cgroup_hierarchies() -> list[Path]:
    """Where a cgroup path is rooted: each v1 hierarchy (this VM), or the one v2 tree."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    return [h for h in CGROUP_ROOT.iterdir() if (h / "cgroup.procs").exists()]


# ---- the node's mount namespace ---------------------------------------------------------

class MountNamespace:
    """A mount namespace of the node's own, held open by a sleeping process: a slave of the
    host's (host mounts reach it, its own never leave) and shared inside (a mount the kubelet
    makes under its root dir reaches runc's containers; their HostToContainer copies see
    the runtime's later mounts and unmounts). The kubelet and containerd enter it
    (:meth:`argv`); ``binds`` are (file of the test, path it hides) pairs mounted first."""

    def __init__(self, directory: Path, binds: list[tuple[Path, Path]]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.process = kube.Process(
            name="mount-namespace", log_path=directory / "mount-namespace.log",
            argv=["unshare", "--mount", "--propagation", "slave", "sleep", "infinity"])
        try:
            self._wait_unshared()
            self.run(["mount", "--make-rshared", "/"])
            for source, target in binds:
                self.run(["mount", "--bind", str(source), str(target)])
        except BaseException:
            self.close()
            raise

    @property
    def path(self) -> str:
        return f"/proc/{self.process.proc.pid}/ns/mnt"

    def _wait_unshared(self, timeout: float = 10.0) -> None:
        own = os.readlink("/proc/self/ns/mnt")
        deadline = time.monotonic() + timeout
        while True:
            self.process.check_alive()
            try:
                if os.readlink(self.path) != own:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no private mount namespace in {timeout}s")
            time.sleep(0.01)

    def argv(self, netns: str | None = None) -> list[str]:
        """The prefix that runs a command in this mount namespace (and network ``netns``)."""
        return ["nsenter", f"--mount={self.path}",
                *([f"--net={netns}"] if netns else []), "--"]

    def run(self, argv: list[str]) -> None:
        subprocess.run([*self.argv(), *argv], check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        self.process.stop()


class NodeContainerd(Containerd):
    """The tests' containerd, run in the node's :class:`MountNamespace` as well as its
    network namespace: the containers it starts see the mounts the kubelet made for them.
    (``mount_ns`` is set before :meth:`start`; a restart enters the same namespace.)"""

    mount_ns: MountNamespace | None = None

    def _netns_argv(self) -> list[str]:
        assert self.mount_ns is not None and self.netns is not None
        return self.mount_ns.argv(str(NETNS_DIR / self.netns))


def node_mount_binds(directory: Path) -> list[tuple[Path, Path]]:
    """The host paths a node's kubelet and containers must not touch, each hidden by a
    file or directory of the test under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    binds = []
    for path, value in KERNEL_TUNABLES.items():
        copy = directory / path.replace("/", ".")
        copy.write_text(value + "\n")
        binds.append((copy, Path("/proc/sys") / path))
    HOST_CONTAINER_LOGS.mkdir(parents=True, exist_ok=True)
    logs = directory / "container-logs"
    logs.mkdir(exist_ok=True)
    binds.append((logs, HOST_CONTAINER_LOGS))
    if XTABLES_LOCK.exists():   # (iptables makes it on first use; otherwise FileOrCreate does)
        lock = directory / "xtables.lock"
        lock.touch()
        binds.append((lock, XTABLES_LOCK))
    return binds


# ---- the app image ---------------------------------------------------------------------

def app_image(client: Path) -> tuple[str, Path]:
    """(image name, OCI tar) of an image whose entrypoint is the Go SDK client ``client``,
    built once per client binary into the tools cache."""
    data = client.read_bytes()
    tag = hashlib.sha256(data).hexdigest()[:12]
    name = f"localhost/kiamfast/go-client:{tag}"
    out = tools_dir() / f"app-image-{tag}" / "app-oci.tar"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(oci_layout([("kiamfast-go-client", data, 0o755)], name,
                                   entrypoint=["/kiamfast-go-client"]))
        tmp.rename(out)
    return name, out


# ---- the kubelet -------------------------------------------------------------------------

class Kubelet:
    """``Kubelet(...).start()`` registers node ``node_name`` and runs its pods on
    ``containerd``, inside the node's ``mount_ns`` and network namespace ``netns`` (a path),
    with address ``node_ip``, reaching the API server at ``api_url``; :meth:`stop` ends the
    process (pods are the containerd's to clean up)."""

    def __init__(self, *, directory: Path, node_name: str, apiserver: kube.ApiServer,
                 containerd: Containerd, mount_ns: MountNamespace, netns: str, node_ip: str,
                 api_url: str, taints: list[dict[str, str]] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.dir = directory
        self.node_name = node_name
        self.apiserver = apiserver
        self.containerd = containerd
        self.mount_ns = mount_ns
        self.netns = netns
        self.node_ip = node_ip
        self.api_url = api_url
        self.taints = taints or []
        self.extra_args = extra_args or []
        self.root_dir = directory / "root"
        self.pod_logs = directory / "pod-logs"
        self.process: kube.Process | None = None

    # -- configuration -------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        low = {"memory.available": "1Mi", "nodefs.available": "1%",
               "nodefs.inodesFree": "1%", "imagefs.available": "1%"}
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": self.containerd.endpoint,
            "imageServiceEndpoint": self.containerd.endpoint,
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.containerd.cgroup_parent,
            "cgroupsPerQOS": True, "failSwapOn": False, "oomScoreAdj": 0,
            "address": "127.0.0.1", "port": kube.free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": kube.free_port(),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.pod_logs),
            "registerNode": True, "registerWithTaints": self.taints,
            "evictionHard": low, "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99, "serializeImagePulls": False,
            "resolvConf": "/etc/resolv.conf", "clusterDomain": "cluster.local",
        }

    def _prepare(self) -> list[str]:
        """The kubelet's directories and files; its argv."""
        for sub in ("root", "pod-logs", "certs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        for hierarchy in cgroup_hierarchies():   # the kubelet wants its cgroup root to exist
            (hierarchy / self.containerd.cgroup_parent.lstrip("/")).mkdir(exist_ok=True)
        config = self.dir / "kubelet.yaml"
        config.write_text(json.dumps(self._config(), indent=1))
        kubeconfig = kube.write_kubeconfig(self.dir / "kubelet.kubeconfig",
                                           server=self.api_url, ca=self.apiserver.ca,
                                           token=self.apiserver.admin.token)
        return [*self.mount_ns.argv(self.netns),
                str(kube.binary("kubelet", kube.KUBE_VERSION)), f"--config={config}",
                f"--kubeconfig={kubeconfig}", f"--root-dir={self.root_dir}",
                f"--cert-dir={self.dir / 'certs'}", f"--hostname-override={self.node_name}",
                f"--node-ip={self.node_ip}", "--v=2", *self.extra_args]

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> Kubelet:
        self.process = kube.Process(name="kubelet", argv=self._prepare(),
                                    log_path=self.dir / "kubelet.log")
        return self

    def wait_registered(self, timeout: float = 60.0) -> dict[str, Any]:
        """The node object once the kubelet has registered it and reports it Ready."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            assert self.process is not None
            self.process.check_alive()
            status, node = self.apiserver.admin.request("GET",
                                                        f"/api/v1/nodes/{self.node_name}")
            if status == 200:
                last = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
                if last.get("Ready") == "True":
                    return node
            time.sleep(0.2)
        raise RuntimeError(f"node {self.node_name} not Ready in {timeout}s (conditions "
                           f"{last}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines) if self.process else ""

    def container_log(self, namespace: str, pod: str, uid: str,
                      container: str = APP_CONTAINER) -> list[str]:
        """What the container printed, line by line, in order. The CRI log format is
        ``<time> <stream> <P|F> <payload>`` per record; a line longer than the runtime's
        record size (16 KiB) comes as P(artial) records ended by an F(ull) one."""
        folder = self.pod_logs / f"{namespace}_{pod}_{uid}" / container
        lines: list[str] = []
        partial = ""
        for log in sorted(folder.glob("*.log")) if folder.is_dir() else ():
            for raw in log.read_text(errors="replace").splitlines():
                parts = raw.split(" ", 3)
                if len(parts) < 3:
                    continue
                payload = parts[3] if len(parts) == 4 else ""
                if parts[2] == "P":
                    partial += payload
                else:
                    lines.append(partial + payload)
                    partial = ""
        return lines

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        try:
            self.apiserver.admin.request("DELETE", f"/api/v1/nodes/{self.node_name}")
        except Exception:  # noqa: BLE001 - the API server may be gone at session end
            pass
