"""kiamfast.kube against the session's real kube-apiserver (tests/k8s/kube.py): every call
the agent and the webhook make, with the agent's own ServiceAccount token and the shipped
ClusterRole unless a test says otherwise, and each way of proving who we are: a bearer
token, a rotating token file, an exec plugin, a client certificate (a second API server on
the same etcd that trusts a client CA), and TLS verified against the cluster's CA."""
from __future__ import annotations

import asyncio
import datetime
import json
import socket
import sys
import textwrap
import threading
from dataclasses import replace

import kube
import orjson
import pytest
import yaml

from kiamfast.kube.client import Client
from kiamfast.kube.config import load_config
from kiamfast.kube.errors import ApiError, ApiUnavailable
from kiamfast.kube.wire import JSON_PATCH

pytestmark = pytest.mark.kube_apiserver

TAINT_KEY = "kiamfast.io/agent-not-ready"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def agent_client(cluster, **kw) -> Client:
    return Client(load_config(kubeconfig=str(cluster.agent_kubeconfig), environ={}, **kw))


def admin_client(cluster) -> Client:
    path = cluster.kubeconfig_for(cluster.admin.token, name="kube-admin")
    return Client(load_config(kubeconfig=str(path), environ={}))


async def whoami(client: Client) -> str:
    review = await client.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                  body={"apiVersion": "authentication.k8s.io/v1",
                                        "kind": "SelfSubjectReview"})
    return review.json()["status"]["userInfo"]["username"]


# ---- the agent's calls --------------------------------------------------------------------------

def test_list_pods_by_field_selector(kube_cluster, unique):
    admin = kube_cluster.admin
    node, other, ns = unique("node"), unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_node(other)
    admin.create_namespace(ns)
    admin.create_pod(ns, "mine", node=node)
    admin.create_pod(ns, "theirs", node=other)

    async def body():
        client = agent_client(kube_cluster)
        for rv in ("0", None):       # from the watch cache, then a consistent read
            listed = (await client.request("GET", "/api/v1/pods", params={
                "fieldSelector": f"spec.nodeName={node}", "resourceVersion": rv})).json()
            assert [p["metadata"]["name"] for p in listed["items"]] == ["mine"]
            assert int(listed["metadata"]["resourceVersion"]) > 0
        assert client.connections_made == 1
        await client.close()
    run(body())


def test_watch_delivers_added_modified_deleted_then_a_bookmark_and_ends(kube_cluster, unique):
    admin = kube_cluster.admin
    node, ns = unique("node"), unique("ns")
    admin.create_node(node)
    admin.create_namespace(ns)

    async def body():
        client = agent_client(kube_cluster)
        listed = (await client.request("GET", "/api/v1/pods", params={
            "fieldSelector": f"spec.nodeName={node}"})).json()
        params = {"watch": True, "allowWatchBookmarks": True, "timeoutSeconds": 4,
                  "resourceVersion": listed["metadata"]["resourceVersion"],
                  "fieldSelector": f"spec.nodeName={node}"}
        seen = []
        async with client.stream("/api/v1/pods", params=params, timeout=(10, 30)) as s:
            admin.create_pod(ns, "p", node=node)
            admin.set_pod_running(ns, "p", "10.244.9.1")
            admin.delete_pod(ns, "p")
            async for line in s.lines():       # ends when the server ends the watch
                event = orjson.loads(line)
                seen.append(event["type"])
        # The real server sends a bookmark shortly before a watch's deadline once something
        # changed past its resourceVersion.
        changes = [t for t in seen if t != "BOOKMARK"]
        # The delete is a MODIFIED (deletionTimestamp set) and then the DELETED.
        assert changes[0] == "ADDED" and changes[-1] == "DELETED", seen
        assert set(changes[1:-1]) == {"MODIFIED"}, seen
        assert seen[len(changes):] and set(seen[len(changes):]) == {"BOOKMARK"}, seen
        await client.close()
    run(body())


def test_watch_from_a_compacted_resource_version_gets_an_error_410_event(
        kube_cluster, uncached_apiserver, unique):
    admin = kube_cluster.admin
    ns = unique("ns")
    admin.create_namespace(ns)
    kubeconfig = kube_cluster.agent_kubeconfig_via(uncached_apiserver.url)

    async def body():
        client = Client(load_config(kubeconfig=str(kubeconfig), environ={}))
        old = (await client.request("GET", "/api/v1/pods", params={"limit": 1})).json()
        # Compacting at revision R keeps R: two writes, so the first event the watch needs
        # is gone.
        admin.create_pod(ns, "bump-1", node=unique("node"))
        admin.create_pod(ns, "bump-2", node=unique("node"))
        kube_cluster.etcd.compact()
        async with client.stream("/api/v1/pods", params={
                "watch": True, "resourceVersion": old["metadata"]["resourceVersion"]}) as s:
            async for line in s.lines():
                event = orjson.loads(line)
                break        # the server may hold the stream open after it: the caller ends it
        assert event["type"] == "ERROR", event
        status = event["object"]
        assert (status["code"], status["reason"]) == (410, "Expired")
    run(body())


def test_get_and_json_patch_a_nodes_taints_as_taint_py_does(kube_cluster, unique):
    admin = kube_cluster.admin
    node = unique("node")
    ours = {"key": TAINT_KEY, "value": "true", "effect": "NoExecute"}
    theirs = {"key": "example.com/other", "effect": "NoSchedule"}
    admin.create_node(node, taints=[theirs, ours])

    async def body():
        client = agent_client(kube_cluster)
        got = (await client.request("GET", f"/api/v1/nodes/{node}")).json()
        taints = got["spec"]["taints"]
        index = next(i for i, t in enumerate(taints) if t["key"] == TAINT_KEY)
        patch = [{"op": "test", "path": f"/spec/taints/{index}", "value": taints[index]},
                 {"op": "remove", "path": f"/spec/taints/{index}"}]
        # The same patch again: its test no longer holds, nothing is written (422).
        patched = (await client.request("PATCH", f"/api/v1/nodes/{node}", body=patch,
                                        content_type=JSON_PATCH)).json()
        left = [t for t in taints if t["key"] != TAINT_KEY]   # theirs, and the server's own
        assert theirs in left and patched["spec"]["taints"] == left
        with pytest.raises(ApiError) as e:
            await client.request("PATCH", f"/api/v1/nodes/{node}", body=patch,
                                 content_type=JSON_PATCH)
        assert e.value.status == 422 and e.value.reason == "Invalid"
        assert admin.get_node(node)["spec"]["taints"] == left
        await client.close()
    run(body())


def test_count_nodes_with_one_node_per_list(kube_cluster, unique):
    for _ in range(3):
        kube_cluster.admin.create_node(unique("node"))

    async def body():
        client = agent_client(kube_cluster)
        page = (await client.request("GET", "/api/v1/nodes", params={"limit": 1})).json()
        total = len(page["items"]) + page["metadata"]["remainingItemCount"]
        assert total == len(kube_cluster.admin.call("GET", "/api/v1/nodes")["items"]) >= 3
    run(body())


def test_a_missing_permission_is_a_403_with_the_servers_message(kube_cluster):
    async def body():
        client = agent_client(kube_cluster)
        with pytest.raises(ApiError) as e:
            await client.request("GET", "/api/v1/secrets")
        assert (e.value.status, e.value.reason) == (403, "Forbidden")
        assert 'User "system:serviceaccount:kube-system:kiamfast" cannot list resource ' \
               '"secrets"' in e.value.message
        assert e.value.retry_after is None
    run(body())


def test_token_review(kube_cluster, unique):
    admin = kube_cluster.admin
    reviewer = unique("reviewer")
    token = kube.service_account_token(admin, namespace="kube-system", name=reviewer)
    admin.call("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": reviewer},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "system:auth-delegator"},
        "subjects": [{"kind": "ServiceAccount", "name": reviewer, "namespace": "kube-system"}]})
    kube.wait_allowed(kube_cluster.as_user(token), group="authentication.k8s.io",
                      resource="tokenreviews", verb="create")
    app = unique("app")
    admin.call("POST", "/api/v1/namespaces/default/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": app}})
    app_token = admin.call("POST", f"/api/v1/namespaces/default/serviceaccounts/{app}/token", {
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"audiences": ["kiamfast-test"], "expirationSeconds": 600}})["status"]["token"]

    async def body():
        client = Client(load_config(kubeconfig=str(kube_cluster.kubeconfig_for(
            token, name=reviewer)), environ={}))

        async def review(audience):
            return (await client.request(
                "POST", "/apis/authentication.k8s.io/v1/tokenreviews", timeout=5, body={
                    "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                    "spec": {"token": app_token, "audiences": [audience]}})).json()["status"]
        good = await review("kiamfast-test")
        assert good["authenticated"] and good["audiences"] == ["kiamfast-test"]
        assert good["user"]["username"] == f"system:serviceaccount:default:{app}"
        assert not (await review("someone-else")).get("authenticated")
        # The agent's own role may not create reviews.
        with pytest.raises(ApiError) as e:
            await agent_client(kube_cluster).request(
                "POST", "/apis/authentication.k8s.io/v1/tokenreviews", body={
                    "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                    "spec": {"token": app_token}})
        assert e.value.status == 403
    run(body())


def test_blocking_service_account_read_for_the_webhook(kube_cluster, unique):
    admin = kube_cluster.admin
    name = unique("sa")
    admin.call("POST", "/api/v1/namespaces/default/serviceaccounts", {
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": name, "annotations": {"kiamfast.io/opt-in": "true"}}})
    client = admin_client(kube_cluster)
    account = client.request_sync("GET", f"/api/v1/namespaces/default/serviceaccounts/{name}",
                                  timeout=2.0).json()
    assert account["metadata"]["annotations"] == {"kiamfast.io/opt-in": "true"}
    with pytest.raises(ApiError) as e:
        client.request_sync("GET", "/api/v1/namespaces/default/serviceaccounts/missing")
    assert e.value.status == 404
    # The agent's identity may not read accounts: a 403, on threads too.
    with pytest.raises(ApiError) as e:
        agent_client(kube_cluster).request_sync(
            "GET", f"/api/v1/namespaces/default/serviceaccounts/{name}")
    assert e.value.status == 403


# ---- TLS and identities -----------------------------------------------------------------------

def test_server_certificate_checked_against_the_configured_ca(kube_cluster):
    token = yaml.safe_load(kube_cluster.agent_kubeconfig.read_text())["users"][0]["user"]["token"]
    url = kube_cluster.apiserver.url

    async def body():
        # --api-server trusts the system's roots, which do not know the test CA.
        client = Client(load_config(api_server=url, api_token=token, environ={}))
        with pytest.raises(ApiUnavailable) as e:
            await client.request("GET", "/api/v1/namespaces")
        assert str(e.value) == (f"TLS to {url}: unable to get local issuer certificate (does "
                                "--api-server name the right certificate authority?)")
        with pytest.raises(ApiUnavailable):
            client.request_sync("GET", "/api/v1/namespaces")
        insecure = Client(load_config(api_server=url, api_token=token, insecure=True,
                                      environ={}))
        assert (await insecure.request("GET", "/api/v1/namespaces")).status == 200
        # A name the certificate does not carry fails; tls-server-name fixes it.
        path = kube_cluster.directory / "renamed.kubeconfig"
        doc = yaml.safe_load(kube_cluster.agent_kubeconfig.read_text())
        doc["clusters"][0]["cluster"]["tls-server-name"] = "kubernetes.invalid"
        path.write_text(yaml.safe_dump(doc))
        with pytest.raises(ApiUnavailable) as e:
            await Client(load_config(kubeconfig=str(path), environ={})).request(
                "GET", "/api/v1/namespaces")
        assert "Hostname mismatch" in str(e.value) or "doesn't match" in str(e.value)
        doc["clusters"][0]["cluster"]["tls-server-name"] = "localhost"
        path.write_text(yaml.safe_dump(doc))
        client = Client(load_config(kubeconfig=str(path), environ={}))
        assert (await client.request("GET", "/api/v1/namespaces")).status == 200
    run(body())


def test_in_cluster_token_file_rotation(kube_cluster, unique, tmp_path):
    """The pod's projected token, refused (its ServiceAccount was deleted), then rotated:
    a 401 makes the next call read the file; later rotations are picked up by the clock."""
    admin = kube_cluster.admin
    gone, first, second = unique("gone"), unique("first"), unique("second")
    tokens = {n: kube.service_account_token(admin, namespace="default", name=n)
              for n in (gone, first, second)}
    admin.call("DELETE", f"/api/v1/namespaces/default/serviceaccounts/{gone}")
    sa_dir = tmp_path / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "ca.crt").write_bytes(kube_cluster.apiserver.ca.read_bytes())

    def project(name):           # as the kubelet does: a new file swapped in
        (sa_dir / "token.new").write_text(tokens[name])
        (sa_dir / "token.new").replace(sa_dir / "token")
    project(gone)
    now = [0.0]
    config = load_config(service_account_dir=str(sa_dir), clock=lambda: now[0],
                         environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                  "KUBERNETES_SERVICE_PORT": str(kube_cluster.apiserver.port)})

    async def body():
        client = Client(config)
        with pytest.raises(ApiError) as e:
            await whoami(client)
        assert e.value.status == 401
        project(first)
        assert await whoami(client) == f"system:serviceaccount:default:{first}"
        project(second)
        assert await whoami(client) == f"system:serviceaccount:default:{first}"
        now[0] += 5.0
        assert await whoami(client) == f"system:serviceaccount:default:{second}"
    run(body())


EXEC_PLUGIN = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    runs = os.environ["RUNS"]
    with open(runs, "a") as f:
        f.write("run\\n")
    n = sum(1 for _ in open(runs))
    tokens = os.environ["TOKENS"].split(",")
    print(json.dumps({{"apiVersion": "client.authentication.k8s.io/v1beta1",
                      "kind": "ExecCredential",
                      "status": {{"token": tokens[min(n, len(tokens)) - 1],
                                 "expirationTimestamp": os.environ["EXPIRES"]}}}}))
    """)


def test_exec_plugin_token_is_run_again_after_a_401(kube_cluster, tmp_path):
    doc = yaml.safe_load(kube_cluster.agent_kubeconfig.read_text())
    token = doc["users"][0]["user"].pop("token")
    plugin = tmp_path / "get-token"
    plugin.write_text(EXEC_PLUGIN.format(python=sys.executable))
    plugin.chmod(0o755)
    expires = (datetime.datetime.now(datetime.timezone.utc)
               + datetime.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc["users"][0]["user"]["exec"] = {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": "./get-token",
        "env": [{"name": "RUNS", "value": str(tmp_path / "runs")},
                {"name": "TOKENS", "value": f"not-a-valid-token,{token}"},
                {"name": "EXPIRES", "value": expires}]}
    path = tmp_path / "exec.kubeconfig"
    path.write_text(yaml.safe_dump(doc))

    async def body():
        client = Client(load_config(kubeconfig=str(path), environ={}))
        with pytest.raises(ApiError) as e:
            await whoami(client)
        assert e.value.status == 401
        assert await whoami(client) == "system:serviceaccount:kube-system:kiamfast"
        assert await whoami(client) == "system:serviceaccount:kube-system:kiamfast"
        assert (tmp_path / "runs").read_text().count("run") == 2   # cached until expiry
    run(body())


@pytest.fixture(scope="module")
def client_cert_apiserver(kube_cluster, tmp_path_factory):
    """A second API server of the cluster that also accepts client certificates from a CA
    of its own; ``.issue(user, groups)`` makes a certificate and key for it (PEM)."""
    directory = tmp_path_factory.mktemp("client-cert-apiserver")
    ca = ClientCa(directory)
    server = kube.ApiServer(directory=directory, etcd=kube_cluster.etcd, pki=kube_cluster.pki,
                            admin_token=kube_cluster.admin.token,
                            name="kube-apiserver-client-ca",
                            extra_args=(f"--client-ca-file={ca.path}",))
    try:
        server.wait_ready(60)
        server.issue = ca.issue
        yield server
    finally:
        server.stop()


class ClientCa:
    def __init__(self, directory) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
        self.x509, self.hashes, self.serialization, self.ec, self.oid = \
            x509, hashes, serialization, ec, NameOID
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kiamfast-client-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
                     .public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))
        self.path = directory / "client-ca.crt"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, user: str, groups: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
        x509, oid = self.x509, self.oid
        key = self.ec.generate_private_key(self.ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        subject = x509.Name([x509.NameAttribute(oid.COMMON_NAME, user),
                             *(x509.NameAttribute(oid.ORGANIZATION_NAME, g) for g in groups)])
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(hours=1))
                .sign(self.key, self.hashes.SHA256()))
        enc = self.serialization
        return (cert.public_bytes(enc.Encoding.PEM),
                key.private_bytes(enc.Encoding.PEM, enc.PrivateFormat.PKCS8,
                                  enc.NoEncryption()))


def test_client_certificate_files_data_and_from_an_exec_plugin(kube_cluster,
                                                                client_cert_apiserver,
                                                                tmp_path):
    server = client_cert_apiserver
    cert, key = server.issue("kiamfast-cert-user")
    (tmp_path / "user.crt").write_bytes(cert)
    (tmp_path / "user.key").write_bytes(key)
    plugin = tmp_path / "cert-plugin"
    plugin.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps(" + repr({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "status": {"clientCertificateData": cert.decode(), "clientKeyData": key.decode()}})
        + "))\n")
    plugin.chmod(0o755)
    import base64
    users = {
        "files": {"client-certificate": "user.crt", "client-key": "user.key"},
        "data": {"client-certificate-data": base64.b64encode(cert).decode(),
                 "client-key-data": base64.b64encode(key).decode()},
        "exec": {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                          "command": str(plugin), "interactiveMode": "Never"}},
    }

    async def body():
        for form, user in users.items():
            path = tmp_path / f"{form}.kubeconfig"
            path.write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "c",
                "clusters": [{"name": "c", "cluster": {
                    "server": server.url, "certificate-authority": str(server.ca)}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
            client = Client(load_config(kubeconfig=str(path), environ={}))
            assert await whoami(client) == "kiamfast-cert-user", form
            account = client.request_sync(
                "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
            assert account.json()["status"]["userInfo"]["username"] == "kiamfast-cert-user"
            await client.close()
    run(body())


# ---- proxies ----------------------------------------------------------------------------------

class ConnectProxy:
    """An HTTP CONNECT proxy on loopback that records what it was asked to reach."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(conn,), daemon=True).start()

    def _tunnel(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        self.requests.append(head.decode())
        host, port = head.split(b" ")[1].decode().rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")

        def pipe(a, b):
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        threading.Thread(target=pipe, args=(upstream, conn), daemon=True).start()
        pipe(conn, upstream)

    def close(self) -> None:
        self.sock.close()


def test_requests_and_watches_through_a_connect_proxy(kube_cluster):
    proxy = ConnectProxy()
    config = load_config(kubeconfig=str(kube_cluster.agent_kubeconfig), environ={})
    # Loopback is never proxied from the environment, so the proxy is set as a kubeconfig's
    # proxy-url would set it.
    config = replace(config, proxy=("127.0.0.1", proxy.port),
                     proxy_authorization="Basic dTpw")

    async def body():
        client = Client(config)
        assert (await client.request("GET", "/api/v1/namespaces")).status == 200
        async with client.stream("/api/v1/namespaces", params={
                "watch": True, "timeoutSeconds": 1}) as s:
            assert [json.loads(line)["type"] async for line in s.lines()][:1] == ["ADDED"]
        assert client.request_sync("GET", "/api/v1/namespaces").status == 200
        await client.close()
    try:
        run(body())
    finally:
        proxy.close()
    target = f"127.0.0.1:{kube_cluster.apiserver.port}"
    assert len(proxy.requests) == 3
    assert all(r.startswith(f"CONNECT {target} HTTP/1.") for r in proxy.requests), \
        proxy.requests
    assert all("Proxy-Authorization: Basic dTpw" in r for r in proxy.requests)
