"""A real etcd and a real kube-apiserver on loopback, for the tests in this directory.

The binaries are the ones ``tests/k8s/build.sh`` builds from the Go module proxy into
``$KIAMFAST_TOOLS/<name>-<version>/``. Everything the servers need is made here, in a temp
directory: a CA and a serving certificate for 127.0.0.1, the service-account signing key
pair, and a token file with one admin identity (group ``system:masters``) that the tests use
to play the cluster: create nodes and pods, write pod status as a kubelet would, and change
taints as other controllers do. The agent itself never gets that identity: it gets a
ServiceAccount token (TokenRequest API) bound to the project's own ClusterRole.

Nothing here talks to anything but 127.0.0.1.
"""
from __future__ import annotations

import base64
import contextlib
import ctypes
import copy
import datetime
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SETUP = "bash tests/k8s/build.sh"


def required_version(gomod: Path, module: str) -> str:
    """The version ``gomod`` requires of ``module``: the one build.sh built."""
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", gomod.read_text(),
                      re.MULTILINE)
    assert match, f"{gomod} does not require {module}"
    return match.group(1)


KUBE_VERSION = required_version(HERE / "kubernetes" / "go.mod", "k8s.io/kubernetes")
ETCD_VERSION = required_version(HERE / "etcd" / "go.mod", "go.etcd.io/etcd/server/v3")
RBAC_MANIFEST = REPO / "deploy" / "base" / "rbac.yaml"


def tools_dir() -> Path:
    return Path(os.environ.get("KIAMFAST_TOOLS") or Path.home() / ".cache/kiamfast/tools")


def binary(name: str, version: str) -> Path:
    return tools_dir() / f"{name}-{version}" / name


def missing_binaries(names: tuple[str, ...] = ("etcd", "kube-apiserver")) -> str | None:
    """The skip reason naming the binaries of ``names`` not built yet, or None."""
    versions = {"etcd": ETCD_VERSION, **{n: KUBE_VERSION for n in (
        "kube-apiserver", "kubelet", "kube-controller-manager", "kube-scheduler", "kubectl")}}
    missing = [str(p) for p in (binary(n, versions[n]) for n in names) if not p.is_file()]
    if missing:
        return f"needs {' and '.join(names)} ({', '.join(missing)}): run {SETUP}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- key material -----------------------------------------------------------------------------

def make_pki(directory: Path, *, server_ips: tuple[str, ...] = ()) -> dict[str, Path]:
    """A CA, a serving cert for 127.0.0.1/localhost (and ``server_ips``) and the
    service-account key pair (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def key() -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(path: Path, k: ec.EllipticCurvePrivateKey) -> Path:
        path.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        return path

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key, sa_key = key(), key(), key()
    # A name of its own: a client trusting two such CAs picks a certificate's issuer by name.
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                            f"kiamfast-test-ca-{secrets.token_hex(4)}")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
              .issuer_name(ca_name).public_key(server_key.public_key())
              .serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(minutes=5))
              .not_valid_after(now + datetime.timedelta(days=1))
              .add_extension(x509.SubjectAlternativeName([
                  x509.DNSName("localhost"),
                  *(x509.IPAddress(ipaddress.ip_address(ip))
                    for ip in ("127.0.0.1", *server_ips))]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"ca": directory / "ca.crt", "cert": directory / "apiserver.crt",
             "sa_pub": directory / "sa.pub"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"] = write_key(directory / "apiserver.key", server_key)
    paths["sa_key"] = write_key(directory / "sa.key", sa_key)
    paths["sa_pub"].write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return paths


# ---- processes ----------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, so a killed run leaves no server."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Process:
    """A child process with its output in a log file; stopped by its own pid only."""

    def __init__(self, *, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


class Etcd:
    """One etcd member on loopback; its v3 JSON gateway compacts on demand."""

    def __init__(self, directory: Path) -> None:
        self.port, peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.process = Process(name="etcd", log_path=directory / "etcd.log", argv=[
            str(binary("etcd", ETCD_VERSION)), "--name=test",
            f"--data-dir={directory / 'etcd-data'}",
            f"--listen-client-urls={self.url}", f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}",
            "--unsafe-no-fsync",          # a throwaway store: no need to wait for the disk
            "--log-level=warn"])
        self.http = urllib3.PoolManager()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.process.check_alive()
            try:
                r = self.http.request("GET", self.url + "/health", timeout=1.0, retries=False)
                if r.status == 200 and json.loads(r.data).get("health") == "true":
                    return
            except (urllib3.exceptions.HTTPError, OSError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy after {timeout}s:\n{self.process.log_tail()}")

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.request("POST", self.url + path, body=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"}, timeout=10.0)
        if r.status != 200:
            raise RuntimeError(f"etcd {path}: HTTP {r.status} {r.data[:200]!r}")
        return json.loads(r.data)

    def revision(self) -> int:
        """The store's current revision (= the newest resourceVersion the API server wrote)."""
        out = self._post("/v3/kv/range", {"key": base64.b64encode(b"/").decode(),
                                          "limit": 1, "keys_only": True})
        return int(out["header"]["revision"])

    def compact(self) -> int:
        """Compact all history up to now (what the API server does every 5 min by default)."""
        rev = self.revision()
        self._post("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    def stop(self) -> None:
        self.process.stop()


class ApiServer:
    """kube-apiserver on loopback: RBAC, service-account tokens, an admin token."""

    def __init__(self, *, directory: Path, etcd: Etcd, pki: dict[str, Path], admin_token: str,
                 name: str = "kube-apiserver", watch_cache: bool = True,
                 service_account_admission: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        """``service_account_admission``: pods created through this server get their
        ServiceAccount's token volume (the controllers that admission needs must run).
        ``extra_args``: more kube-apiserver flags."""
        directory.mkdir(parents=True, exist_ok=True)
        tokens = directory / "tokens.csv"
        tokens.write_text(f'{admin_token},test-admin,test-admin-uid,"system:masters"\n')
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca = pki["ca"]
        argv = [
            str(binary("kube-apiserver", KUBE_VERSION)),
            f"--etcd-servers={etcd.url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.port}",
            f"--tls-cert-file={pki['cert']}", f"--tls-private-key-file={pki['key']}",
            "--authorization-mode=RBAC", "--anonymous-auth=false",
            f"--token-auth-file={tokens}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki['sa_pub']}",
            f"--service-account-signing-key-file={pki['sa_key']}",
            "--service-cluster-ip-range=10.96.0.0/24",   # allocations only, never dialled
            "--endpoint-reconciler-type=none",
            # No controller-manager creates the "default" ServiceAccount of new namespaces.
            *([] if service_account_admission else ["--disable-admission-plugins=ServiceAccount"]),
            "--etcd-compaction-interval=0",   # the tests compact, when they mean to
            "--enable-priority-and-fairness=false", "--profiling=false",
            f"--watch-cache={'true' if watch_cache else 'false'}",
            "--v=1", *extra_args,
        ]
        self.process = Process(name=name, argv=argv, log_path=directory / f"{name}.log")
        self.admin = Client(url=self.url, ca=self.ca, token=admin_token)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self.process.check_alive()
            try:
                status, body = self.admin.request("GET", "/readyz", raw=True, timeout=2.0)
                if status == 200:
                    return
                last = f"HTTP {status}: {body[-300:]!r}"
            except (urllib3.exceptions.HTTPError, OSError) as e:
                last = repr(e)
            time.sleep(0.1)
        raise RuntimeError(f"kube-apiserver not ready after {timeout}s ({last}):\n"
                           f"{self.process.log_tail()}")

    def stop(self) -> None:
        self.process.stop()


# ---- a small REST client (the test's hands; the agent uses the kubernetes client) -------------

class ApiError(Exception):
    def __init__(self, status: int, body: Any, what: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {body}")
        self.status = status
        self.body = body


class Client:
    """JSON over HTTPS to the API server with one bearer token, verified against our CA."""

    def __init__(self, *, url: str, ca: Path, token: str) -> None:
        self.url = url
        self.token = token
        self.http = urllib3.PoolManager(cert_reqs="CERT_REQUIRED", ca_certs=str(ca),
                                        maxsize=8)

    def request(self, method: str, path: str, body: Any = None, *, raw: bool = False,
                content_type: str = "application/json", timeout: float = 15.0):
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        r = self.http.request(method, self.url + path, body=data, headers=headers,
                              timeout=timeout, retries=False)
        if raw:
            return r.status, r.data
        try:
            return r.status, json.loads(r.data) if r.data else None
        except ValueError:
            return r.status, r.data.decode(errors="replace")

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        status, out = self.request(method, path, body, **kw)
        if status >= 400:
            raise ApiError(status, out, f"{method} {path}")
        return out

    # The few objects the tests make.

    def create_namespace(self, name: str, annotations: dict[str, str] | None = None) -> Any:
        return self.call("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "annotations": annotations or {}}})

    def create_node(self, name: str, taints: list[dict[str, str]] | None = None) -> Any:
        return self.call("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "spec": {"taints": taints or []}})

    def create_pod(self, ns: str, name: str, *, node: str,
                   annotations: dict[str, str] | None = None) -> Any:
        """A pod bound to ``node`` (no scheduler here): Pending until its status is written."""
        return self.call("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"nodeName": node, "containers": [{"name": "app", "image": "app:test"}]}})

    def set_pod_running(self, ns: str, name: str, ip: str) -> Any:
        """What the kubelet writes once the sandbox has its address (status subresource)."""
        return self.call("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", {
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                       "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}]}},
            content_type="application/merge-patch+json")

    def set_pod_phase(self, ns: str, name: str, phase: str) -> Any:
        return self.call("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                         {"status": {"phase": phase}},
                         content_type="application/merge-patch+json")

    def delete_pod(self, ns: str, name: str, *, grace: int = 0) -> Any:
        # Without a kubelet a graceful delete only marks the pod terminating.
        return self.call("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}"
                                   f"?gracePeriodSeconds={grace}")

    def get_pod(self, ns: str, name: str) -> Any:
        return self.call("GET", f"/api/v1/namespaces/{ns}/pods/{name}")

    def annotate_namespace(self, name: str, annotations: dict[str, str]) -> Any:
        return self.call("PATCH", f"/api/v1/namespaces/{name}",
                         {"metadata": {"annotations": annotations}},
                         content_type="application/merge-patch+json")

    def get_node(self, name: str) -> Any:
        return self.call("GET", f"/api/v1/nodes/{name}")


# ---- the agent's identity -------------------------------------------------------------------------

_PLURAL = {"ClusterRole": "clusterroles", "ClusterRoleBinding": "clusterrolebindings"}


def rbac_documents() -> list[dict[str, Any]]:
    """The project's own ClusterRole and binding, as deploy/base/rbac.yaml has them."""
    return [d for d in yaml.safe_load_all(RBAC_MANIFEST.read_text()) if d]


def apply_rbac(admin: Client, documents: list[dict[str, Any]]) -> None:
    for doc in documents:
        admin.call("POST", f"/apis/rbac.authorization.k8s.io/v1/{_PLURAL[doc['kind']]}", doc)


def service_account_token(admin: Client, *, namespace: str, name: str) -> str:
    """Create ServiceAccount ``namespace/name`` and get a token for it (TokenRequest API)."""
    admin.call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    out = admin.call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600}})
    return out["status"]["token"]


def write_kubeconfig(path: Path, *, server: str, ca: Path, token: str) -> Path:
    """A kubeconfig as a user would hand the agent with --kubeconfig."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server,
                                                  "certificate-authority": str(ca)}}],
        "users": [{"name": "agent", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "agent"}}]}))
    return path


def new_admin_token() -> str:
    return secrets.token_urlsafe(24)


def wait_allowed(client: Client, *, verb: str, resource: str, group: str = "",
                 timeout: float = 10.0) -> None:
    """Wait until ``client``'s identity may ``verb`` ``resource`` of API ``group`` (default:
    the core group), asking SelfSubjectAccessReview (which every authenticated user may):
    a new binding takes effect when the server's RBAC informers have seen it, a moment
    after the POST."""
    deadline = time.monotonic() + timeout
    while True:
        out = client.call("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"group": group, "verb": verb,
                                            "resource": resource}}})
        if out["status"].get("allowed"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{verb} {resource} still not allowed after {timeout}s: {out}")
        time.sleep(0.05)


# ---- the cluster ------------------------------------------------------------------------------

@dataclass
class Cluster:
    directory: Path
    etcd: Etcd
    apiserver: ApiServer
    admin: Client
    agent_kubeconfig: Path
    pki: dict[str, Path]
    start_seconds: float
    _identities: dict[str, Path] = field(default_factory=dict)

    def kubeconfig_for(self, token: str, *, name: str, server: str | None = None) -> Path:
        return write_kubeconfig(self.directory / f"{name}.kubeconfig",
                                     server=server or self.apiserver.url,
                                     ca=self.apiserver.ca, token=token)

    def agent_kubeconfig_via(self, url: str) -> Path:
        """The agent's own token, aimed at another address of the same cluster (a proxy, a
        second API server)."""
        token = yaml.safe_load(self.agent_kubeconfig.read_text())["users"][0]["user"]["token"]
        return self.kubeconfig_for(token, name=f"agent-{url.rsplit(':', 1)[1]}", server=url)

    def as_user(self, token: str) -> Client:
        return Client(url=self.apiserver.url, ca=self.apiserver.ca, token=token)

    def identity_without(self, name: str, *, drop: list[tuple[str, str]]) -> Path:
        """A kubeconfig for ServiceAccount kube-system/<name> bound to a copy of the project's
        ClusterRole without the (resource, verb) pairs in ``drop``; every other rule as
        shipped."""
        if name in self._identities:
            return self._identities[name]
        role, binding = (copy.deepcopy(d) for d in rbac_documents())
        assert role["kind"] == "ClusterRole" and binding["kind"] == "ClusterRoleBinding"
        granted = {(res, verb) for rule in role["rules"] for res in rule["resources"]
                   for verb in rule["verbs"]}
        assert set(drop) <= granted, f"the shipped role does not grant all of {drop}"
        rules = []
        for rule in role["rules"]:
            for res in rule["resources"]:   # one rule per resource, so one verb can go
                verbs = [v for v in rule["verbs"] if (res, v) not in drop]
                if verbs:
                    rules.append({**rule, "resources": [res], "verbs": verbs})
        role["metadata"] = {"name": name}
        role["rules"] = rules
        binding["metadata"] = {"name": name}
        binding["roleRef"]["name"] = name
        binding["subjects"] = [{"kind": "ServiceAccount", "name": name,
                                "namespace": "kube-system"}]
        apply_rbac(self.admin, [role, binding])
        token = service_account_token(self.admin, namespace="kube-system", name=name)
        wait_allowed(self.as_user(token), verb=rules[0]["verbs"][0],
                          resource=rules[0]["resources"][0])
        self._identities[name] = self.kubeconfig_for(token, name=name)
        return self._identities[name]


@contextlib.contextmanager
def running_cluster(directory: Path) -> Iterator[Cluster]:
    """etcd and kube-apiserver in ``directory``, the agent's ServiceAccount bound to the
    project's ClusterRole; stopped on exit."""
    started = time.monotonic()
    pki = make_pki(directory / "pki")
    etcd = Etcd(directory)
    apiserver = None
    try:
        etcd.wait_ready(20)
        apiserver = ApiServer(directory=directory, etcd=etcd, pki=pki,
                              admin_token=new_admin_token())
        apiserver.wait_ready(60)
        admin = apiserver.admin
        token = service_account_token(admin, namespace="kube-system", name="kiamfast")
        apply_rbac(admin, rbac_documents())
        # RBAC takes effect when the server's informers see the binding: wait for that.
        wait_allowed(Client(url=apiserver.url, ca=apiserver.ca, token=token),
                     verb="watch", resource="pods")
        agent = write_kubeconfig(directory / "agent.kubeconfig", server=apiserver.url,
                                 ca=apiserver.ca, token=token)
        yield Cluster(directory=directory, etcd=etcd, apiserver=apiserver, admin=admin,
                      agent_kubeconfig=agent, pki=pki, start_seconds=time.monotonic() - started)
    finally:
        if apiserver is not None:
            apiserver.stop()
        etcd.stop()
