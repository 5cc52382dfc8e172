"""Real AWS SDKs in pods get exactly their own pod's credentials through the agent.

One node, one agent, a pod per client, each pod with a role of its own. Each client is the
unmodified SDK with nothing AWS-related in its environment, so its default credential chain
ends at 169.254.169.254 and goes through the node's DNAT rule to the agent, as in a cluster.
What a user would check is checked: the SDK returns credentials, and STS says they belong to
the pod's role (GetCallerIdentity against the same STS that issued them). No credential
request ever reaches the node's metadata service.
"""

from __future__ import annotations

import pytest

from e2e_cluster import Node, assert_own_role
from needs import need_js_sdk

pytestmark = pytest.mark.root

PODS = {
    # name: (ip, role, namespace)
    "boto-v2": ("10.77.0.20", "role-boto-v2", "default"),
    "boto-v1": ("10.77.0.21", "role-boto-v1", "default"),
    "boto-no-v1": ("10.77.0.22", "role-boto-no-v1", "payments"),
    "awscli": ("10.77.0.23", "role-awscli", "default"),
    "js": ("10.77.0.24", "role-js", "frontend"),
    "no-role": ("10.77.0.25", None, "default"),
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, netns_available):
    node = Node(tmp_path_factory.mktemp("sdk-node"))
    try:
        for name, (ip, role, namespace) in PODS.items():
            node.add_pod(name, ip, role=role, namespace=namespace)
        agent = node.start_agent()
        for name, pod in node.pods.items():
            if pod.role is not None:
                sample = pod.wait_credentials()
                assert sample.ok, f"{name}: agent never served credentials: {sample}\n" \
                    + agent.log()
        yield node
    except AssertionError:
        print("\n===== agent output =====\n" + node.agent_logs())
        raise
    finally:
        node.close()


def test_botocore_imdsv2(cluster):
    pod = cluster.pods["boto-v2"]
    creds = pod.botocore_credentials()
    assert creds.get("method") == "iam-role", creds
    assert_own_role(pod, creds)
    assert cluster.imds_credential_requests() == []


def test_botocore_imdsv1_when_the_token_put_is_refused(cluster):
    pod = cluster.pods["boto-v1"]
    pod.refuse_token_put()
    try:
        creds = pod.botocore_credentials()
        assert pod.refused_token_puts() > 0, "botocore never tried a token PUT"
    finally:
        pod.allow_token_put()
    assert creds.get("method") == "iam-role", creds
    assert_own_role(pod, creds)
    assert cluster.imds_credential_requests() == []


def test_botocore_with_imdsv1_disabled(cluster):
    pod = cluster.pods["boto-no-v1"]
    creds = pod.botocore_credentials(AWS_EC2_METADATA_V1_DISABLED="true")
    assert creds.get("method") == "iam-role", creds
    assert_own_role(pod, creds)


def test_aws_cli_get_caller_identity(cluster):
    pod = cluster.pods["awscli"]
    ident = pod.awscli_identity()
    assert "Arn" in ident, ident
    assert f":assumed-role/{pod.role}/" in ident["Arn"], ident


def test_javascript_sdk_v3(cluster):
    need_js_sdk()
    pod = cluster.pods["js"]
    creds = pod.js_credentials()
    assert creds.get("exit") == 0, creds
    assert_own_role(pod, creds)
    assert creds["Expiration"].endswith("Z"), creds


def test_pod_without_role_gets_no_credentials_not_the_nodes(cluster):
    pod = cluster.pods["no-role"]
    assert pod.fetch().status == 404
    creds = pod.botocore_credentials(who_am_i=False)
    assert (creds.get("error"), creds.get("exit")) == ("no credentials", 3), creds
    assert cluster.imds_credential_requests() == []


def test_every_sdk_pod_kept_its_own_identity(cluster):
    """After all the clients ran: each pod, asked again, still gets only its own role."""
    for pod in cluster.pods.values():
        sample = pod.fetch()
        if pod.role is None:
            assert sample.status == 404, (pod, sample)
        else:
            assert sample.ok and sample.role == pod.role, (pod, sample)
            assert cluster.sts.role_of(sample.access_key) == pod.role, (pod, sample)
