"""The AWS SDKs for Go v2 and Java v2, unmodified, get their own pod's credentials.

Beside botocore, the AWS CLI and the JavaScript SDK (test_e2e_sdks.py), the two SDKs most
Kubernetes services are written with, each in two ways a service really builds it:

* Go: ``config.LoadDefaultConfig`` (the whole default chain, ending at the IMDS role
  provider) and ``ec2rolecreds.New()`` behind an ``aws.CredentialsCache``;
* Java: ``DefaultCredentialsProvider.create()`` and
  ``InstanceProfileCredentialsProvider.create()``.

They run (tests/sdk, built by tests/sdk/build.sh) in pod network namespaces with nothing
AWS-related in their environment, so the SDK goes to 169.254.169.254 through the node's DNAT
rule to the agent, with its own default timeouts (Go: 250 ms connect, 500 ms to the
response headers, 3 attempts; Java: 1 s, 1 attempt). Every check ends where a user's would:
the SDK returned credentials, and STS GetCallerIdentity, signed by the SDK with them, names
the pod's role (and the key is one STS issued for that role, never the node's).

Cases, for every client:

* IMDSv1: the pod's token PUTs die with a TCP reset, the agent allows token-less requests;
* IMDSv2 only: the agent refuses token-less requests (``--imdsv2=required``) and the SDK is
  told never to fall back (``AWS_EC2_METADATA_V1_DISABLED``; Go's ``ec2rolecreds.New()``
  builds its own IMDS client and ignores it, but still has to use tokens here);
* the early pod: the pod's address reaches the API server only 150 ms after the SDK's first
  packet, and the SDK's first call, with its own timeouts and retries, must succeed;
* a reused address: a pod with role A gives its address to a new pod with role B while the
  API server still lists the old one; the SDK in B gets B, also after the late delete.

And the refresh near expiry, for the clients whose cache can be told when to refresh: the
agent rotates each key after ~10 s (it never serves a key with less than 59m45s of its 1 h
left), the SDK's own cache considers credentials expired 59m47s before their Expiration
(~12 s after STS issued them). So within one process the SDK serves from its cache, then asks
the agent again, after the agent rotated, and must get the new key, valid per STS.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime, timedelta

import pytest
from sdk_clients import CLIENTS, need_client, run_client

from e2e_cluster import ACCOUNT, NODE_ACCESS_KEY_PREFIX, Node, Pod
from netns import METADATA_IP

pytestmark = pytest.mark.root

CLIENT_NAMES = list(CLIENTS)
# The clients whose credential cache can be told to refresh early (Go: ExpiryWindow, Java:
# InstanceProfileCredentialsProvider's staleTime; DefaultCredentialsProvider has no such knob).
REFRESHING_CLIENTS = ["go-default", "go-ec2rolecreds", "java-instance-profile"]
# Where the SDK says its credentials came from: Go's Credentials.Source, Java's providerName(),
# which in 2.57 is the business-metric code of the source ("0" = CREDENTIALS_IMDS).
PROVIDER_NAMES = {"go": ("Source", "EC2RoleProvider"), "java": ("ProviderName", "0")}

SESSION = 3600                 # the agent's default --session-duration
SERVE_WINDOW = 15              # the agent serves a key this long after STS issued it
MIN_LIFETIME = "59m45s"        # = SESSION - SERVE_WINDOW, as the agent's flag
CACHE_WINDOW = SESSION - 13    # the SDK's cache: expired 12-13 s after STS issued the key
# (the agent rotates at 9-10 s; Expiration has whole seconds, so up to 1 s is lost there)
REFRESH_ROUNDS, REFRESH_INTERVAL = 10, 2.0
PUBLISH_DELAY = 0.15           # early pod: its IP reaches the API server this long after
                               # the SDK's first packet (within the agent's 350 ms hold)


def pod_ip(case: int, client: str) -> str:
    """A distinct address per case and client on a node (10.77.0.<case*10 + n>)."""
    return f"10.77.0.{case * 10 + CLIENT_NAMES.index(client)}"


def start_node(tmp_path_factory, label: str, *agent_args: str):
    node = Node(tmp_path_factory.mktemp(label))
    try:
        node.start_agent(extra_args=agent_args)
    except BaseException:
        node.close()
        raise
    return node


@pytest.fixture(scope="module")
def node_v1_allowed(tmp_path_factory, netns_available):
    node = start_node(tmp_path_factory, "go-java-v1", "--imdsv2=optional")
    yield node
    node.close()


@pytest.fixture(scope="module")
def node_v2_only(tmp_path_factory, netns_available):
    node = start_node(tmp_path_factory, "go-java-v2", "--imdsv2=required")
    yield node
    node.close()


@pytest.fixture(scope="module")
def node_short_serving(tmp_path_factory, netns_available):
    node = start_node(tmp_path_factory, "go-java-refresh",
                      f"--min-credential-lifetime={MIN_LIFETIME}")
    yield node
    node.close()


def ready_pod(node: Node, name: str, ip: str, *, role: str) -> Pod:
    """A running pod whose credentials the agent already holds (tests not about timing)."""
    pod = node.add_pod(name, ip, role=role)
    sample = pod.wait_credentials()
    assert sample.ok, f"{pod}: the agent never served credentials: {sample}\n" \
        + node.agent_logs()
    return pod


def assert_own_role(node: Node, pod: Pod, client: str, doc: dict) -> None:
    """The client got credentials from the metadata provider, and STS says they are the
    pod's role: every round of its run."""
    assert doc.get("exit") == 0, f"{client} in {pod}: {doc}\n" + node.agent_logs()
    field, provider = PROVIDER_NAMES[CLIENTS[client][0]]
    for r in doc.get("rounds", [doc]):
        key = r.get("AccessKeyId", "")
        assert not key.startswith(NODE_ACCESS_KEY_PREFIX), f"{pod} got the NODE's role: {r}"
        assert r.get(field) == provider, f"{client}: credentials not from IMDS: {r}"
        assert node.sts.role_of(key) == pod.role, \
            f"{client} in {pod}: key {key} was issued for {node.sts.role_of(key)!r}: {r}"
        assert f":assumed-role/{pod.role}/" in r.get("Arn", ""), f"{client}: STS said {r}"
        assert r.get("Account") == ACCOUNT, r
    assert node.imds_credential_requests() == [], "a credential request reached the node's IMDS"


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_imdsv1_when_the_token_put_is_refused(node_v1_allowed, client):
    need_client(client)
    node = node_v1_allowed
    pod = ready_pod(node, f"v1-{client}", pod_ip(3, client), role=f"role-v1-{client}")
    pod.refuse_token_put()
    try:
        doc = run_client(pod, client)
        refused = pod.refused_token_puts()
    finally:
        pod.allow_token_put()
    assert refused > 0, f"{client} never tried a token PUT, so this was not its v1 fallback"
    assert_own_role(node, pod, client, doc)


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_imdsv2_only(node_v2_only, client):
    need_client(client)
    node = node_v2_only
    pod = ready_pod(node, f"v2-{client}", pod_ip(3, client), role=f"role-v2-{client}")
    assert pod.fetch(token=False).status == 401, "the agent still answers token-less requests"
    doc = run_client(pod, client, AWS_EC2_METADATA_V1_DISABLED="true")
    assert_own_role(node, pod, client, doc)


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_first_call_before_the_api_server_has_the_pod_ip(node_v1_allowed, client):
    need_client(client)
    node = node_v1_allowed
    name = f"early-{client}"
    pod = node.add_pod(name, pod_ip(4, client), role=f"role-early-{client}", ip_in_api=False)
    # The API server learns the address only once the SDK has started asking, as when a
    # container starts before the kubelet's status update.
    publisher = PublishIpWhenAsked(pod, delay=PUBLISH_DELAY).start()
    try:
        doc = run_client(pod, client)  # at once, as a container that starts with its pod
    finally:
        published_after = publisher.stop()

    assert_own_role(node, pod, client, doc)
    assert published_after is not None, \
        "the API server had the IP before the SDK asked: this did not test the early pod"


class PublishIpWhenAsked:
    """Publish a pod's address to the API server ``delay`` seconds after the pod's first
    connection attempt to the metadata address (counted by a netfilter rule in the pod)."""

    def __init__(self, pod: Pod, *, delay: float) -> None:
        self.pod, self.delay = pod, delay
        self.rule = ["OUTPUT", "-p", "tcp", "-d", METADATA_IP, "--dport", "80", "--syn",
                     "-m", "comment", "--comment", "first-metadata-syn", "-j", "ACCEPT"]
        self.published_after: float | None = None  # seconds after the first SYN
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "PublishIpWhenAsked":
        self.pod.net.ns.run(["iptables", "-I", *self.rule], check=True)
        self._thread.start()
        return self

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(10)
        self.pod.net.ns.run(["iptables", "-D", *self.rule])
        return self.published_after

    def _syns(self) -> int:
        out = self.pod.net.ns.run(["iptables", "-L", "OUTPUT", "-v", "-n", "-x"]).stdout
        return sum(int(line.split()[0]) for line in out.splitlines()
                   if "first-metadata-syn" in line)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._syns() > 0:
                seen = time.monotonic()
                time.sleep(self.delay)
                api, pod = self.pod.node.api, self.pod
                api.pods.set_ips(pod.namespace, pod.name, [pod.ip])
                api.pods.set_phase(pod.namespace, pod.name, "Running")
                self.published_after = time.monotonic() - seen
                return
            time.sleep(0.01)


@pytest.mark.parametrize("client", CLIENT_NAMES)
def test_reused_address_gets_the_new_pods_role(node_v1_allowed, client):
    need_client(client)
    node = node_v1_allowed
    ip = pod_ip(5, client)
    old = ready_pod(node, f"reuse-old-{client}", ip, role=f"role-old-{client}")
    assert_own_role(node, old, client, run_client(old, client))

    # The old pod's sandbox is gone and its address handed to a new pod with another role;
    # the API server still lists the old pod, Running, with that address (late delete).
    node.remove_pod_net(old)
    new = node.add_pod(f"reuse-new-{client}", ip, role=f"role-new-{client}")
    assert node.api.pods.get("default", old.name)["status"]["podIP"] == ip

    assert_own_role(node, new, client, run_client(new, client))

    node.api.pods.delete("default", old.name)  # the late delete changes nothing for the new pod
    assert_own_role(node, new, client, run_client(new, client))


@pytest.mark.parametrize("client", REFRESHING_CLIENTS)
def test_refresh_near_expiry_gets_the_rotated_credentials(node_short_serving, client):
    need_client(client)
    node = node_short_serving
    pod = ready_pod(node, f"refresh-{client}", pod_ip(3, client), role=f"role-refresh-{client}")

    served_before = documents_served(node)
    doc = run_client(pod, client, loop=REFRESH_ROUNDS, interval=REFRESH_INTERVAL,
                     cache_window=CACHE_WINDOW)
    fetches = documents_served(node) - served_before  # only this client asks meanwhile

    assert_own_role(node, pod, client, doc)
    rounds = doc["rounds"]
    keys = [r["AccessKeyId"] for r in rounds]
    distinct = list(dict.fromkeys(keys))
    assert fetches >= 2, f"{client} asked the agent {fetches} time(s) in {len(keys)} rounds"
    assert fetches < len(keys), f"{client} asked the agent every round: its cache was unused"
    assert len(distinct) >= 2, \
        f"{client} asked {fetches} times but always got {distinct}: the agent never rotated"
    assert keys == sorted(keys, key=distinct.index), f"{client} went back to an old key: {keys}"
    for r in rounds:
        left = expiration(client, r) - parse_time(r["at"])
        assert left > timedelta(minutes=55), f"{client} used credentials {left} from expiry: {r}"


def documents_served(node: Node) -> int:
    """Credential documents the agent has answered with 200 (its /metrics counter)."""
    status, body = node.http("GET", "/metrics")
    assert status == 200, body[:500]
    match = re.search(rb'^kiamfast_http_requests_total\{handler="roleHandler",code="200"\} '
                      rb'(\d+)$', body, re.M)
    assert match, "no roleHandler counter in /metrics"
    return int(match.group(1))


def parse_time(text: str) -> datetime:
    """RFC 3339 / ISO-8601 as the clients print it (Z, up to nanoseconds)."""
    text = text.replace("Z", "+00:00")
    head, _, frac_tz = text.partition(".")
    if frac_tz:  # datetime takes microseconds at most
        digits = frac_tz[:frac_tz.index("+")]
        text = f"{head}.{digits[:6]}{frac_tz[len(digits):]}"
    return datetime.fromisoformat(text)


def expiration(client: str, r: dict) -> datetime:
    """The Expiration the metadata service sent. Go reports the cache's own expiry, which is
    the ExpiryWindow earlier; Java reports the document's."""
    if CLIENTS[client][0] == "go":
        return parse_time(r["Expires"]) + timedelta(seconds=CACHE_WINDOW)
    return parse_time(r["Expiration"])
