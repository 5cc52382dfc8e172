"""A real containerd for the tests, run as a child process with everything of its own.

kiamfast learns who owns a pod address from the node's container runtime, so its tests need
one: Debian's containerd 1.6 with runc and the CNI bridge + host-local plugins, driven
through the same CRI gRPC calls the kubelet makes (RunPodSandbox, StopPodSandbox,
RemovePodSandbox, PodSandboxStatus). Real sandboxes, real network namespaces, real
addresses from host-local, real reuse of an address.

`Containerd` owns one directory ``/tmp/kf-ctd-<pid>-<random>/`` (short: socket paths are
limited to 108 bytes) holding its config, root, state, gRPC socket, runc root, CNI conflist
and host-local data dir, sandbox logs, and a bridge of its own name. Everything in
../shared/reference/cri.md "A real containerd on this kind of VM" is applied here:
`restrict_oom_score_adj` (no CAP_SYS_RESOURCE), no AppArmor, cgroupfs, overlayfs,
netns files under the state dir, `isGateway: false` (the bridge plugin would otherwise turn
on the host's ip_forward), and a sandbox image built here, since no registry is reachable:
tests/cri/pause.c compiled with ``gcc -static`` and packed as an OCI image layout tar by
Python (tarfile, hashlib, json), cached under ``$KIAMFAST_TOOLS/pause-<hash of pause.c>/``.

With ``netns="<name>"`` containerd is started through ``nsenter --net`` inside that network
namespace (only the network namespace: its mounts stay visible to the tests), so the bridge
and every pod veth live there, and no 10.x address ever touches the host's own network.
The tests in tests/cri always do that, in a fresh namespace standing for the node
(`NodeNetns`); an agent under test runs in the same namespace.

Cleanup removes sandboxes, containerd, leftover shims and pause processes, mounts, the
bridge, the cgroup parent and the directory. A run killed half-way leaves a directory whose
pid is dead; the next `Containerd` sweeps those first, so it never breaks the next run.
This module never touches a process, mount or link it did not create.
"""
from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

HERE = Path(__file__).resolve().parent
SETUP = "sh tests/cri/setup.sh"
CNI_BIN = Path("/usr/lib/cni")
DIR_PREFIX = "kf-ctd-"
SHIM_SOCKET_DIR = Path("/run/containerd/s")   # the shim always puts its socket here
CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")


def tools_dir() -> Path:
    return Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")


def unavailable_reason() -> str | None:
    """Why a real containerd cannot run here (the skip reason), or None."""
    if os.geteuid() != 0:
        return "real-containerd tests need root (containerd, network namespaces): run as root"
    for tool in ("containerd", "runc", "ctr", "containerd-shim-runc-v2"):
        if shutil.which(tool) is None:
            return f"real-containerd tests need `{tool}` (containerd): run `{SETUP}`"
    for plugin in ("bridge", "ptp", "host-local", "loopback"):
        if not (CNI_BIN / plugin).exists():
            return (f"real-containerd tests need {CNI_BIN / plugin} "
                    f"(containernetworking-plugins): run `{SETUP}`")
    for tool in ("gcc", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"real-containerd tests need `{tool}`: run `{SETUP}`"
    return None


# -- the pause image --------------------------------------------------------------------

def pause_version() -> str:
    return hashlib.sha256((HERE / "pause.c").read_bytes()).hexdigest()[:12]


def pause_image_name() -> str:
    return f"localhost/kiamfast/pause:{pause_version()}"


def build_pause_image() -> Path:
    """The pause image as an OCI layout tar, built once into the tools cache."""
    out = tools_dir() / f"pause-{pause_version()}"
    image = out / "pause-oci.tar"
    if image.exists():
        return image
    out.mkdir(parents=True, exist_ok=True)
    binary = out / "pause"
    subprocess.run(["nice", "-n", "10", "gcc", "-static", "-O2", "-o", str(binary),
                    str(HERE / "pause.c")], check=True, capture_output=True)
    tmp = image.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(oci_layout([("pause", binary.read_bytes(), 0o755)], pause_image_name(),
                               entrypoint=["/pause"]))
    tmp.rename(image)
    return image


def _tar(members: Sequence[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def oci_layout(files: Sequence[tuple[str, bytes, int]], name: str, *,
               entrypoint: Sequence[str]) -> bytes:
    """An image ``ctr images import`` takes: index.json -> manifest -> (config, one
    uncompressed layer holding ``files`` as (path, content, mode))."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes, media_type: str) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    layer = _tar(files)
    layer_desc = blob(layer, "application/vnd.oci.image.layer.v1.tar")
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": blob(config, "application/vnd.oci.image.config.v1+json"),
        "layers": [layer_desc],
    }, sort_keys=True).encode()
    manifest_desc = blob(manifest, "application/vnd.oci.image.manifest.v1+json")
    manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}
    manifest_desc["platform"] = {"architecture": "amd64", "os": "linux"}
    index = json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}).encode()
    members = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644),
               ("index.json", index, 0o644)]
    members += [(f"blobs/sha256/{d.split(':')[1]}", data, 0o644) for d, data in blobs.items()]
    return _tar(members)


# -- the node's network namespace -------------------------------------------------------

_STALE_NODE = re.compile(r"^kf-node-(\d+)-[0-9a-f]+$")


def _delete_netns(name: str) -> None:
    """Kill what runs in the namespace (containerd, shims, an agent), then delete it."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                          text=True).stdout.split()
    _kill([int(pid) for pid in pids])
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NodeNetns:
    """A fresh network namespace standing for the node: ``kf-node-<pid>-<random>`` (the
    e2e harness recognises and frees the same names), loopback up. Namespaces of that name
    whose pid is dead (a killed run) are deleted first."""

    def __init__(self) -> None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            m = _STALE_NODE.match(line.split(" ", 1)[0])
            if m and not Path(f"/proc/{m.group(1)}").exists():
                _delete_netns(m.group(0))
        self.name = f"kf-node-{os.getpid()}-{secrets.token_hex(3)}"
        self.path = str(NETNS_DIR / self.name)
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        self.run(["ip", "link", "set", "lo", "up"])

    def run(self, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *argv], check=True,
                              capture_output=True, text=True, **kw)

    def delete(self) -> None:
        _delete_netns(self.name)


# -- containerd ------------------------------------------------------------------------

@dataclass(frozen=True)
class SandboxInfo:
    id: str
    name: str
    uid: str
    namespace: str
    ip: str
    additional_ips: tuple[str, ...]
    netns_path: str   # where `nsenter --net=` enters the sandbox's network
    pid: int          # the pause process


class Containerd:
    """One containerd with its own everything; `start()`, use, `close()`."""

    def __init__(self, *, netns: str | None = None, subnet: str = "10.88.0.0/24",
                 subnet6: str | None = None, call_timeout: float = 10.0,
                 cni: str = "bridge") -> None:
        sweep_stale_runs()
        assert cni in ("bridge", "ptp"), cni
        self.cni = cni        # ptp: a veth and a host route per pod, as Calico or the AWS CNI
        self.netns = netns
        self.subnet = ipaddress.ip_network(subnet)
        self.subnet6 = ipaddress.ip_network(subnet6) if subnet6 else None
        self.dir = Path(f"/tmp/{DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        self.socket = self.dir / "c.sock"
        self.endpoint = f"unix://{self.socket}"
        self.bridge = "kfc" + secrets.token_hex(4)
        self.cgroup_parent = f"/kiamfast-cri-{self.dir.name}"
        self.call_timeout = call_timeout
        self.process: subprocess.Popen | None = None
        self.sandboxes: dict[str, SandboxInfo] = {}
        self._channel: grpc.Channel | None = None
        self._runtime: Any = None
        self._range: tuple[str | None, str | None] = (None, None)

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    @property
    def gateway6(self) -> str | None:
        return str(self.subnet6.network_address + 1) if self.subnet6 else None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Containerd:
        """Set up (first time) and start containerd; returns once CRI answers."""
        first = not self.dir.exists()
        if first:
            for sub in ("root", "state", "runc", "cni", "ipam", "logs", "opt"):
                (self.dir / sub).mkdir(parents=True)
            # A shared mount, as a systemd host's directories are: the sandboxes' network
            # namespaces containerd mounts here later reach a process in a mount namespace
            # of its own that is a slave of this one (an agent's container, HostToContainer).
            subprocess.run(["mount", "--bind", str(self.dir), str(self.dir)], check=True,
                           capture_output=True)
            subprocess.run(["mount", "--make-shared", str(self.dir)], check=True,
                           capture_output=True)
            (self.dir / "config.toml").write_text(self._config())
            # what a sweep after a killed run needs to find the bridge again
            bridge = self.bridge if self.cni == "bridge" else None
            (self.dir / "owner.json").write_text(json.dumps({"bridge": bridge,
                                                              "netns": self.netns}))
            self._write_conflist()
            if self.cni == "bridge":
                self._make_bridge()
        self._spawn()
        if first:
            self.import_image(build_pause_image())
        return self

    def import_image(self, oci_tar: Path) -> None:
        """Load an OCI layout tar into the CRI's image store (no registry is reachable)."""
        subprocess.run(["ctr", "-a", str(self.socket), "-n", "k8s.io", "images", "import",
                        "--platform", "linux/amd64", str(oci_tar)],
                       check=True, capture_output=True, timeout=60)

    def _netns_argv(self) -> list[str]:
        return ["nsenter", f"--net={NETNS_DIR / self.netns}", "--"] if self.netns else []

    def _spawn(self) -> None:
        log = open(self.dir / "containerd.log", "ab")
        self.process = subprocess.Popen(
            [*self._netns_argv(), "containerd", "--config", str(self.dir / "config.toml")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"containerd exited {self.process.returncode}:\n{self.log_tail()}")
            if self.socket.exists():
                try:
                    self.call("Version", cri.VersionRequest(version="v1"), timeout=1)
                    return
                except grpc.RpcError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not answer CRI in 20 s:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL containerd only (a runtime crash): shims and sandboxes live on."""
        self._drop_channel()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.kill()
        self._spawn()

    def close(self) -> None:
        """Everything goes: sandboxes, containerd, shims, mounts, bridge, cgroups, files."""
        if self.process is not None and self.process.poll() is None:
            try:   # also the sandboxes a kubelet made through this containerd
                listed = [s.id for s in self.call(
                    "ListPodSandbox", cri.ListPodSandboxRequest(), timeout=5).items]
            except grpc.RpcError:
                listed = []
            for sandbox_id in dict.fromkeys([*self.sandboxes, *listed]):
                try:
                    self.remove_sandbox(sandbox_id)
                except grpc.RpcError:
                    pass
            self._drop_channel()
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._drop_channel()
        _cleanup_dir(self.dir)

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join((self.dir / "containerd.log").read_text().splitlines()[-lines:])
        except OSError:
            return ""

    # -- configuration -----------------------------------------------------------------

    def _config(self) -> str:
        d = self.dir
        cri_plugin = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"

[{cri_plugin}]
  sandbox_image = "{pause_image_name()}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
[{cri_plugin}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri_plugin}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri_plugin}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{d}/runc"
[{cri_plugin}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{d}/cni"
  max_conf_num = 1
"""

    def set_range(self, start: str | None, end: str | None) -> None:
        """host-local hands out only [start, end] from now on; `start == end` makes the next
        sandbox get exactly that address once it is free. None, None: the whole subnet."""
        self._range = (start, end)
        self._write_conflist()

    def _write_conflist(self) -> None:
        v4: dict[str, Any] = {"subnet": str(self.subnet), "gateway": self.gateway}
        start, end = self._range
        if start:
            v4["rangeStart"] = start
        if end:
            v4["rangeEnd"] = end
        ranges = [[v4]]
        routes = [{"dst": "0.0.0.0/0"}]
        if self.subnet6:
            ranges.append([{"subnet": str(self.subnet6), "gateway": self.gateway6}])
            routes.append({"dst": "::/0"})
        ipam = {"type": "host-local", "dataDir": str(self.dir / "ipam"), "ranges": ranges,
                "routes": routes}
        # ptp puts the gateway address on every host end and a host route to the pod on it
        plugin = ({"type": "ptp", "ipMasq": False, "ipam": ipam} if self.cni == "ptp" else
                  {"type": "bridge", "bridge": self.bridge, "isGateway": False,
                   "ipMasq": False, "ipam": ipam})
        conflist = {"cniVersion": "0.4.0", "name": f"kiamfast-{self.dir.name}",
                    "plugins": [plugin]}
        target = self.dir / "cni" / "10-kiamfast.conflist"
        tmp = self.dir / "cni" / ".conflist.tmp"   # not a name libcni loads
        tmp.write_text(json.dumps(conflist, indent=1))
        tmp.rename(target)

    def _ip(self, *argv: str) -> None:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        subprocess.run([*prefix, "ip", *argv], check=True, capture_output=True)

    def _make_bridge(self) -> None:
        """The bridge exists before the plugin runs, with the node's address on it, so the
        node (and an agent in its namespace) routes to the pods without isGateway."""
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        if self.subnet6:
            self._ip("addr", "add", f"{self.gateway6}/{self.subnet6.prefixlen}", "dev",
                     self.bridge, "nodad")
        self._ip("link", "set", self.bridge, "up")

    # -- CRI ---------------------------------------------------------------------------

    def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        if self._runtime is None:
            self._channel = grpc.insecure_channel(self.endpoint,
                                                  options=[("grpc.enable_http_proxy", 0)])
            self._runtime = cri_grpc.RuntimeServiceStub(self._channel)
        return getattr(self._runtime, method)(request, timeout=timeout or self.call_timeout)

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._runtime = None

    def run_sandbox(self, name: str, *, uid: str | None = None, namespace: str = "default",
                    labels: Mapping[str, str] | None = None,
                    annotations: Mapping[str, str] | None = None,
                    host_network: bool = False, attempt: int = 0,
                    kubelet_labels: bool = True) -> SandboxInfo:
        """RunPodSandbox as the kubelet does it: metadata, the three io.kubernetes.pod.*
        labels plus `labels`, the pod's annotations, network namespace POD (or NODE)."""
        uid = uid or secrets.token_hex(16)
        all_labels = dict(labels or {})
        if kubelet_labels:
            all_labels.update({"io.kubernetes.pod.uid": uid, "io.kubernetes.pod.name": name,
                               "io.kubernetes.pod.namespace": namespace})
        log_dir = self.dir / "logs" / f"{namespace}_{name}_{uid}"
        log_dir.mkdir(parents=True, exist_ok=True)
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace,
                                            attempt=attempt),
            hostname="" if host_network else name[:63],   # runc: no hostname on the node's UTS
            log_directory=str(log_dir), labels=all_labels, annotations=dict(annotations or {}),
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=self.cgroup_parent,
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=cri.NamespaceOption(
                        network=cri.NODE if host_network else cri.POD,
                        pid=cri.CONTAINER, ipc=cri.POD))))
        sandbox_id = self.call("RunPodSandbox",
                               cri.RunPodSandboxRequest(config=config)).pod_sandbox_id
        answer = self.call("PodSandboxStatus",
                           cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True))
        info = json.loads(answer.info.get("info", "{}"))
        pid = int(info.get("pid", 0))
        netns_path = f"/proc/{pid}/ns/net"
        for ns in info.get("runtimeSpec", {}).get("linux", {}).get("namespaces", []):
            if ns.get("type") == "network" and ns.get("path"):
                netns_path = ns["path"]
        status = answer.status
        sandbox = SandboxInfo(id=sandbox_id, name=name, uid=uid, namespace=namespace,
                              ip=status.network.ip,
                              additional_ips=tuple(x.ip for x in status.network.additional_ips),
                              netns_path=netns_path, pid=pid)
        self.sandboxes[sandbox_id] = sandbox
        return sandbox

    def stop_sandbox(self, sandbox_id: str) -> None:
        self.call("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id))

    def remove_sandbox(self, sandbox_id: str) -> None:
        """Stop (idempotent) and remove, as the kubelet's garbage collector does."""
        self.stop_sandbox(sandbox_id)
        self.call("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id))
        self.sandboxes.pop(sandbox_id, None)

    def status(self, sandbox_id: str) -> Any:
        return self.call("PodSandboxStatus",
                         cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id)).status

    def exec_in_sandbox(self, sandbox_id: str, argv: Sequence[str], *,
                        env: Mapping[str, str] | None = None, timeout: float = 30,
                        check: bool = True,
                        input: str | None = None) -> subprocess.CompletedProcess:
        """Run `argv` on the host's filesystem inside the sandbox's network namespace only
        (a client "in the pod": its source address is the sandbox's). `env` is the whole
        environment of the command (None: the test's own)."""
        netns_path = self.sandboxes[sandbox_id].netns_path
        return subprocess.run(["nsenter", f"--net={netns_path}", "--", *argv],
                              env=dict(env) if env is not None else None, timeout=timeout,
                              check=check, capture_output=True, text=True, input=input)


# -- cleanup, also of runs that were killed half-way -------------------------------------

def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _children(pid: int) -> list[int]:
    found = []
    for other in _pids():
        try:
            stat = Path(f"/proc/{other}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(other)
    return found


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cleanup_dir(d: Path) -> None:
    """Kill what ran from `d` (containerd, its shims and their pause processes), unmount
    whatever is mounted under it, drop shim sockets, cgroup parent and bridge, remove it."""
    config, socket = str(d / "config.toml"), str(d / "c.sock")
    try:
        owner = json.loads((d / "owner.json").read_text())
    except (OSError, ValueError):
        owner = {}
    for pid in _pids():
        argv = _cmdline(pid)
        if config in argv:
            _kill([pid])
        elif "containerd-shim-runc-v2" in (argv[0] if argv else "") and socket in argv:
            _kill(_children(pid) + [pid])
    task_dir = d / "state" / "io.containerd.runtime.v2.task" / "k8s.io"
    if task_dir.is_dir():
        for sandbox_id in os.listdir(task_dir):
            shim = hashlib.sha256(f"{socket}/k8s.io/{sandbox_id}".encode()).hexdigest()
            (SHIM_SOCKET_DIR / shim).unlink(missing_ok=True)
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{d}/") or m == str(d)), key=len,
                        reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True)
    parent = f"kiamfast-cri-{d.name}"
    # each v1 hierarchy below CGROUP_ROOT, or (cgroup v2) CGROUP_ROOT itself
    for hierarchy in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()] if CGROUP_ROOT.is_dir() else ():
        group = hierarchy / parent
        if group.is_dir():   # deepest first: a kubelet nests kubepods/<qos>/pod<uid>/<id>
            for sub, _, _ in sorted(os.walk(group), key=lambda w: -len(w[0])):
                try:
                    os.rmdir(sub)
                except OSError:
                    pass
    if owner.get("bridge"):
        netns = owner.get("netns")
        if not netns or (NETNS_DIR / netns).exists():
            prefix = ["ip", "netns", "exec", netns] if netns else []
            subprocess.run([*prefix, "ip", "link", "del", owner["bridge"]], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


_STALE = re.compile(rf"^{DIR_PREFIX}(\d+)-[0-9a-f]+$")


def sweep_stale_runs() -> list[Path]:
    """Clean up after test processes that died without closing their containerd."""
    removed = []
    for entry in Path("/tmp").iterdir():
        m = _STALE.match(entry.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _cleanup_dir(entry)
            removed.append(entry)
    return removed
