"""The container-credentials protocol served by the whole agent, against a real kube-apiserver.

What a user checks: an SDK in a pod, given AWS_CONTAINER_CREDENTIALS_FULL_URI and a pod-bound
token file, gets its own pod's role (STS says so), whoever sends the token; every token the
pod does not hold for this node is refused with the protocol's JSON error and status.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent_process import Agent
from agent_process import http as imds_http
from needs import JS_DIR, need_js_sdk
from sdk_clients import go_client, java_client, need_client
from podid import (
    BASE_ARN,
    claims_of,
    create_pod,
    create_service_account,
    other_key,
    pod_token,
    resigned,
)

from kiamfast.testing.net import free_port

pytestmark = pytest.mark.kube_apiserver

ALLOWED = ["role-a", "role-b", "default-role"]


class Node:
    """This module's node, namespace and agent (one start for every test here)."""

    def __init__(self, cluster, peers, workdir, unique, extra: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.admin = cluster.admin
        self.name, self.other = unique("node"), unique("node")
        self.ns = unique("ns")
        self.admin.create_node(self.name)
        self.admin.create_node(self.other)
        self.admin.create_namespace(self.ns, annotations={
            "iam.amazonaws.com/allowed-roles": json.dumps([BASE_ARN + r for r in ALLOWED])})
        create_service_account(self.admin, self.ns, "app")
        self.port = free_port()
        self.agent = Agent(peers, workdir, extra=[
            f"--node={self.name}", f"--container-credentials-addr=127.0.0.1:{self.port}",
            "--namespace-restrictions", "--default-role=default-role", *extra])
        self.agent.wait_ready()
        self.sts_url = peers.sts.url
        self._ips = iter(f"10.250.{i // 250}.{i % 250 + 1}" for i in range(10000))
        # Where requests come from: each test stands for a pod of its own, with an address
        # (and so a per-address TokenReview budget) of its own, as on a node.
        self._sources = iter(f"127.0.{i // 250 + 1}.{i % 250 + 1}" for i in range(10000))
        self.source = next(self._sources)

    def next_source(self) -> None:
        self.source = next(self._sources)

    def pod(self, name: str, *, role: str | None = None, node: str | None = None,
            host_network: bool = False, ip: str | None = None,
            env: dict[str, str] | None = None) -> str:
        return create_pod(self.admin, self.ns, name, node=node or self.name, sa="app",
                          ip=ip or next(self._ips), role=role, host_network=host_network,
                          env=env)

    def by_token(self) -> dict[str, str]:
        """A container's variables that send its SDK to this listener (the webhook's)."""
        return {"AWS_CONTAINER_CREDENTIALS_FULL_URI":
                f"http://127.0.0.1:{self.port}/v1/credentials",
                "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE": "/var/run/secrets/kiamfast.io/token"}

    def token(self, name: str, uid: str, **kw) -> str:
        return pod_token(self.admin, self.ns, "app", name, uid, **kw)

    def ask(self, token: str | None, *, path: str = "/v1/credentials", method: str = "GET",
            source: str | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10,
                                          source_address=(source or self.source, 0))
        try:
            conn.request(method, path, headers={"Authorization": token} if token else {})
            resp = conn.getresponse()
            assert resp.getheader("Content-Type") == "application/json"
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def answered(self, token: str, timeout: float = 15.0) -> tuple[int, dict]:
        """The first answer that is not 'not yet' (503: the pod's credentials are fetched
        when the watch delivers it)."""
        deadline = time.monotonic() + timeout
        while True:
            status, body = self.ask(token)
            if status != 503 or time.monotonic() > deadline:
                return status, body
            time.sleep(0.05)


@pytest.fixture(scope="module")
def node(cluster, peers, tmp_path_factory):
    import secrets
    n = Node(cluster, peers, tmp_path_factory.mktemp("agent"),
             lambda prefix: f"{prefix}-{secrets.token_hex(3)}")
    yield n
    n.agent.stop()


@pytest.fixture(autouse=True)
def own_address(request):
    """A test's requests come from an address no earlier test used (not the SDK runs: an
    SDK connects from 127.0.0.1)."""
    if "node" in request.fixturenames:
        request.getfixturevalue("node").next_source()


HERE = Path(__file__).resolve().parent
# The JS SDK prints the credentials it got; STS says whose they are.
JS_THEN_STS = ("import json, subprocess, sys, botocore.session as s; "
               "c = json.loads(subprocess.run(['node', sys.argv[1]], check=True, "
               "capture_output=True, text=True).stdout); "
               "sts = s.get_session().create_client('sts', aws_access_key_id=c['accessKeyId'], "
               "aws_secret_access_key=c['secretAccessKey'], aws_session_token=c['sessionToken']); "
               "print('{\"Arn\": \"%s\"}' % sts.get_caller_identity()['Arn'])")
BOTOCORE = ("import botocore.session as s; c = s.get_session().create_client('sts'); "
            "print('{\"Arn\": \"%s\"}' % c.get_caller_identity()['Arn'])")
SDKS = {   # an SDK's default chain in a fresh process; its last line {"Arn": ...} or the ARN
    "botocore": lambda home: [sys.executable, "-c", BOTOCORE],
    "awscli": lambda home: ["aws", "sts", "get-caller-identity", "--query", "Arn",
                            "--output", "text"],
    "go-default": lambda home: [str(go_client()), "--provider", "default"],
    "java-default": lambda home: ["java", f"-Duser.home={home}", "-jar", str(java_client()),
                                  "--provider", "default"],
    "js": lambda home: [sys.executable, "-c", JS_THEN_STS,
                        str(HERE / "container-credentials.js")],
}


def sdk_identity(node: Node, sdk: str, token_file, home, *, timeout: float = 60) -> str:
    """GetCallerIdentity's ARN for a fresh process whose only credential source is the
    container provider (the SDK's default chain, as in a pod)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONTAINER_CREDENTIALS_FULL_URI=f"http://127.0.0.1:{node.port}/v1/credentials",
               AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE=str(token_file),
               AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL_STS=node.sts_url,
               AWS_REGION="us-east-1", AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               HOME=str(home), NODE_PATH=str(JS_DIR / "node_modules"))
    out = subprocess.run(SDKS[sdk](home), env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip(), (out.stdout[-2000:], out.stderr[-2000:])
    last = out.stdout.strip().splitlines()[-1]
    return json.loads(last)["Arn"] if last.startswith("{") else last


@pytest.mark.parametrize("sdk", list(SDKS))
def test_an_sdk_gets_its_own_pods_role(node, tmp_path, sdk):
    if sdk == "js":
        need_js_sdk()
    elif sdk not in ("botocore", "awscli"):
        need_client(sdk)
    uid_a = node.pod(f"{sdk}-a", role="role-a")
    uid_b = node.pod(f"{sdk}-b", role="role-b")
    for name, uid, role in ((f"{sdk}-a", uid_a, "role-a"), (f"{sdk}-b", uid_b, "role-b")):
        token_file = tmp_path / f"{name}.token"
        token_file.write_text(node.token(name, uid))
        arn = sdk_identity(node, sdk, token_file, tmp_path)
        assert arn.startswith(f"arn:aws:sts::123456789012:assumed-role/{role}/"), arn


def test_default_role_and_namespace_policy_apply(node):
    plain = node.pod("plain")                       # no annotation: --default-role
    denied = node.pod("denied", role="role-c")      # not in the namespace's allowed roles
    status, body = node.answered(node.token("plain", plain))
    assert status == 200, body
    status, body = node.answered(node.token("denied", denied))
    assert status == 403 and body["Code"] == "AccessDenied", body
    assert "role-c" in body["Message"]
    # No role for a pod without an address of its own, as on the metadata path.
    host = node.pod("host", role="role-a", host_network=True)
    status, body = node.answered(node.token("host", host))
    assert (status, body["Code"]) == (403, "AccessDenied") and "host network" in body["Message"]


def caller_arn(node: Node, creds: dict) -> str:
    """STS's word on whose credentials these are."""
    import botocore.session
    sts = botocore.session.get_session().create_client(
        "sts", region_name="us-east-1", endpoint_url=node.sts_url,
        aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
        aws_session_token=creds["Token"])
    return sts.get_caller_identity()["Arn"]


def imds_credentials(node: Node, source: str) -> tuple[int, bytes]:
    """The metadata path's answer to a pod at ``source``: its role's credentials."""
    deadline = time.monotonic() + 15
    while True:
        status, listing = imds_http(node.agent.port, "GET /latest/meta-data/iam/security-credentials/",
                               source=source)
        if status == 200:
            return imds_http(node.agent.port, "GET /latest/meta-data/iam/security-credentials/"
                        + listing.decode().strip(), source=source)
        if status != 503 or time.monotonic() > deadline:
            return status, listing
        time.sleep(0.05)


def test_a_pod_that_asks_by_token_is_refused_by_address(node):
    """Both at once: a pod whose container asks this listener by token gets nothing on the
    metadata path (an SDK falling back to IMDS, as Java's chain does, would otherwise be
    identified by its address again); a pod without the variables keeps kube2iam's
    contract."""
    by_token = node.pod("by-token", role="role-a", ip="127.0.250.1", env=node.by_token())
    node.pod("by-address", role="role-b", ip="127.0.250.2")
    status, body = node.answered(node.token("by-token", by_token))
    assert status == 200, body
    assert "assumed-role/role-a/" in caller_arn(node, body)
    status, body = imds_credentials(node, "127.0.250.1")
    assert status == 404 and b"AccessKeyId" not in body, body
    status, body = imds_credentials(node, "127.0.250.2")
    assert status == 200, body
    assert "assumed-role/role-b/" in caller_arn(node, json.loads(body))


def test_a_host_network_pod_that_asks_by_token_gets_its_own_role(node):
    """The node's address is not a hostNetwork pod's own, so no address path can tell such
    pods apart; their tokens can."""
    uid_a = node.pod("host-a", role="role-a", host_network=True, env=node.by_token())
    uid_b = node.pod("host-b", role="role-b", host_network=True, env=node.by_token())
    for name, uid, role in (("host-a", uid_a, "role-a"), ("host-b", uid_b, "role-b")):
        status, body = node.answered(node.token(name, uid))
        assert status == 200, body
        assert f"assumed-role/{role}/" in caller_arn(node, body)


def test_a_token_is_the_identity_wherever_it_is_sent_from(node):
    """The protocol binds nothing to the address: a pod's token sent from another address
    (another pod's) gets the token's pod's role, never the sender's."""
    uid = node.pod("replayed", role="role-b")
    token = node.token("replayed", uid)
    status, first = node.answered(token)
    assert status == 200, first
    status, again = node.ask(token, source="127.0.0.77")
    assert status == 200 and again["AccessKeyId"] == first["AccessKeyId"]


def test_the_answer_has_the_protocol_fields_and_survives_token_rotation(node):
    uid = node.pod("rotating", role="role-a")
    status, first = node.answered(node.token("rotating", uid))
    assert status == 200, first
    assert set(first) == {"AccessKeyId", "SecretAccessKey", "Token", "AccountId", "Expiration"}
    assert first["AccountId"] == "123456789012"
    assert first["Expiration"].endswith("Z") and len(first["Expiration"]) == 20
    # The kubelet's next token for the same pod: the same credentials (cached by pod and
    # role, not by token), no new AssumeRole.
    status, second = node.ask(node.token("rotating", uid))
    assert status == 200 and second["AccessKeyId"] == first["AccessKeyId"]


def test_a_deleted_pods_token_stops_working_at_once(node):
    uid = node.pod("doomed", role="role-a")
    token = node.token("doomed", uid)
    assert node.answered(token)[0] == 200
    node.admin.delete_pod(node.ns, "doomed")
    # The verdict is cached for the token's 10 minutes; the pod watch ends it.
    deadline = time.monotonic() + 10
    while (answer := node.ask(token))[0] == 200:
        assert time.monotonic() < deadline, "the deleted pod's token still works"
        time.sleep(0.05)
    assert answer[0] == 403 and answer[1]["Code"] == "AccessDenied", answer


def test_a_pod_on_another_node_is_refused(node):
    uid = node.pod("elsewhere", role="role-a", node=node.other)
    status, body = node.ask(node.token("elsewhere", uid))
    assert status == 403 and body["Code"] == "AccessDenied", body
    assert node.other not in body["Message"] and "not on" in body["Message"]


def test_tokens_the_api_server_would_refuse(node, tmp_path):
    uid = node.pod("victim", role="role-a")
    good = node.token("victim", uid)
    assert node.answered(good)[0] == 200
    sa_key = node.cluster.pki["sa_key"]
    now = int(time.time())
    cases = {
        "no token": None,
        "not a JWT": "not-a-token",
        "another audience": node.token("victim", uid, audience="sts.amazonaws.com"),
        # genuine: signed by the cluster's key, expired past the API server's leeway
        "expired": resigned(good, sa_key, iat=now - 1200, nbf=now - 1200, exp=now - 120),
        "forged": resigned(good, other_key(tmp_path)),
    }
    for case, token in cases.items():
        status, body = node.ask(token)
        assert (status, body.get("Code")) == (400, "InvalidToken"), (case, body)
        assert body["Message"], case


def test_a_cached_verdict_ends_when_the_token_expires(node):
    uid = node.pod("brief", role="role-a")
    token = resigned(node.token("brief", uid), node.cluster.pki["sa_key"],
                     exp=int(time.time()) + 4)
    assert node.answered(token)[0] == 200
    while time.time() < claims_of(token)["exp"]:     # the token's own clock: the wall's
        time.sleep(0.1)
    status, body = node.ask(token)
    assert (status, body["Code"]) == (400, "InvalidToken"), body
    assert "expired" in body["Message"]


def test_unknown_paths_and_methods(node):
    uid = node.pod("paths", role="role-a")
    token = node.token("paths", uid)
    status, body = node.ask(token, path="/v2/credentials")
    assert (status, body["Code"]) == (404, "NotFound")
    status, body = node.ask(token, method="POST")
    assert (status, body["Code"]) == (405, "MethodNotAllowed")


def test_the_listener_outlives_a_control_process_restart(node):
    """The supervisor holds the socket: a request sent while the control process is dead
    waits in its backlog and is answered by the next one (last here: it restarts the
    module's control process)."""
    uid = node.pod("steady", role="role-a")
    token = node.token("steady", uid)
    status, before = node.answered(token)
    assert status == 200, before
    [control] = node.agent.children("kiamfast.control")
    os.kill(control, signal.SIGKILL)
    status, body = node.ask(token)       # connects at once; answered once control is back
    assert status in (200, 503), body
    status, after = node.answered(token)
    assert status == 200 and after["AccessKeyId"] == before["AccessKeyId"], after
    assert node.agent.children("kiamfast.control") != [control]
