"""Real AWS SDKs get their pod's credentials from kube2iam 0.15 itself and from kiamfast, in
the same harness: so the SDK tests test what a kube2iam user sees, and kiamfast is judged
beside it.

Each agent is the agent of its own e2e node (kube2iam_node: kube2iam with its own
``--iptables`` DNAT, kiamfast with the DaemonSet's flags), one pod per client with a role of
its own. The clients are the unmodified SDKs of tests/e2e (botocore's default chain, the AWS
CLI, the JavaScript SDK v3, and the Go v2 and Java v2 clients of tests/sdk, each both ways a
service builds it), with nothing AWS-related in their environment, so each goes to
169.254.169.254 through the node's DNAT rule. Both agents have served each pod once before
its SDK runs (the steady state, not a cold STS call). A client passes when it returned
credentials that STS issued for the pod's role and GetCallerIdentity, signed with them,
names that role.

A second case runs botocore, the JS and the Go SDK (their three timeout regimes: 1 s and
one attempt, 1 s and no retry, 0.5 s to the headers and three attempts) in a new pod whose
role nobody has asked for yet (Running, its address in the API, its role listed by the
agent), with each of the agents' AssumeRole calls taking 0.3 s (AWS's take 0.1-0.5 s):
kube2iam calls STS while the SDK waits, kiamfast fetched the credentials when the pod was
scheduled. Asserted for kiamfast, recorded for kube2iam.

The steady state is asserted for both agents: every client works with kube2iam too. The
outcomes are printed (``SDK {...}`` lines, ``-s``) and merged into the file
``KUBE2IAM_SDKS_RECORD`` names, if set.
"""
from __future__ import annotations

import http.client

import pytest

from kube2iam_node import AGENTS, skip_unless_available, start_agent  # first: sys.path

from e2e_cluster import NODE_ACCESS_KEY_PREFIX, Node  # noqa: I001 (needs the path above)
from netns import METADATA_IP, call_in_netns
from runtime_node import wait_until
from needs import missing_js_sdk
from race_record import module_record
from sdk_clients import CLIENTS, missing_reason, run_client

pytestmark = pytest.mark.root

SDKS = ["botocore", "awscli", "js", *CLIENTS]
STS_LATENCY = 0.3   # the first-call case: each AssumeRole of an agent takes this long
FIRST_CALL_SDKS = ["botocore", "js", "go-default"]
RECORD, _write_record = module_record("SDK", "KUBE2IAM_SDKS_RECORD")


def pod_ip(sdk: str, *, cold: bool = False) -> str:
    return f"10.77.0.{(60 if cold else 40) + SDKS.index(sdk)}"


def role_for(sdk: str) -> str:
    return f"role-sdk-{sdk}"


@pytest.fixture(scope="module", params=AGENTS)
def node(request, tmp_path_factory):
    """(node, agent name): a node with a pod per SDK, each served once by the agent."""
    skip_unless_available(runtime=False)
    node = Node(tmp_path_factory.mktemp(f"sdks-{request.param}"))
    try:
        for sdk in SDKS:
            node.add_pod(sdk, pod_ip(sdk), role=role_for(sdk))
        start_agent(node, request.param)
        for pod in node.pods.values():
            sample = pod.wait_credentials()
            assert sample.ok, f"{pod}: never served credentials: {sample}\n" + node.agent_logs()
        yield node, request.param
    finally:
        node.close()


def missing(sdk: str) -> str | None:
    if sdk == "js":
        return missing_js_sdk()
    if sdk in CLIENTS:
        return missing_reason(CLIENTS[sdk][0])
    return None


def need_sdk(node_and_agent: tuple, sdk: str) -> tuple:
    """(node, agent name) of the fixture, once the SDK's client is known to be built."""
    reason = missing(sdk)
    if reason:
        pytest.skip(reason)
    return node_and_agent


def run_sdk(pod, sdk: str) -> dict:
    """The SDK's credentials and what STS's GetCallerIdentity said of them (``Arn``)."""
    if sdk == "botocore":
        return pod.botocore_credentials()
    if sdk == "awscli":
        return pod.awscli_identity()
    if sdk == "js":
        return pod.js_credentials()
    return run_client(pod, sdk)


def verdict(node, pod, doc: dict) -> str:
    """"own role", or why not: what a user checking the SDK's answer would see."""
    rounds = doc.get("rounds", [doc])
    for r in rounds:
        key, arn = r.get("AccessKeyId"), r.get("Arn")
        if key is None and arn is None:
            return "no credentials: " + str(doc.get("error") or doc.get("stderr", ""))[-300:]
        if key is not None:
            if key.startswith(NODE_ACCESS_KEY_PREFIX):
                return f"the NODE's credentials: {key}"
            if node.sts.role_of(key) != pod.role:
                return f"a key STS issued for {node.sts.role_of(key)!r}"
        if arn is not None and f":assumed-role/{pod.role}/" not in arn:
            return f"GetCallerIdentity says {arn}"
    return "own role"


@pytest.mark.parametrize("sdk", SDKS)
def test_sdk_gets_its_pods_own_role(node, sdk):
    node, agent = need_sdk(node, sdk)
    pod = node.pods[sdk]
    doc = run_sdk(pod, sdk)
    outcome = verdict(node, pod, doc)
    RECORD.add(agent, sdk, {"outcome": outcome, "exit": doc.get("exit")})
    assert outcome == "own role", f"{sdk} against {agent}: {doc}\n" + node.agent_logs()
    assert node.imds_credential_requests() == [], "a credential request reached the node's IMDS"


def listed_role(pod) -> str | None:
    """The role the agent lists to ``pod`` (a token-less listing; no STS call in either
    agent), or None."""
    def go() -> str | None:
        conn = http.client.HTTPConnection(METADATA_IP, 80, timeout=1.0)
        try:
            conn.request("GET", "/latest/meta-data/iam/security-credentials/")
            resp = conn.getresponse()
            body = resp.read().decode(errors="replace")
            return body if resp.status == 200 else None
        finally:
            conn.close()
    try:
        return call_in_netns(pod.net.ns, go)
    except OSError:
        return None


@pytest.mark.parametrize("sdk", FIRST_CALL_SDKS)
def test_sdk_first_call_for_a_role_nobody_asked_for_yet(node, sdk):
    node, agent = need_sdk(node, sdk)
    node.sts.proxy.latency = STS_LATENCY
    try:
        pod = node.add_pod(f"cold-{sdk}", pod_ip(sdk, cold=True), role=f"role-cold-{sdk}")
        wait_until(lambda: listed_role(pod) == pod.role, timeout=20,
                   what=f"{agent} listing {pod.role} to {pod}")
        doc = run_sdk(pod, sdk)
    finally:
        node.sts.proxy.latency = 0.0
    outcome = verdict(node, pod, doc)
    RECORD.add(agent, f"{sdk}: first call for a new role", {"outcome": outcome,
                                                            "exit": doc.get("exit")})
    if agent == "kiamfast":
        assert outcome == "own role", f"{sdk}: {doc}\n" + node.agent_logs()
