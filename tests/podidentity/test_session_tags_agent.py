"""EKS-style session tags through the whole agent: a pod's token, the real kube-apiserver,
the agent's container-credentials answer, moto's STS behind the recording proxy.

What a user checks: GetCallerIdentity with the credentials a pod got names a session of its
own, ``assumed-role/<role>/eks-<cluster>-<pod>-<UID prefix>``, and the AssumeRole call
behind it carried EKS Pod Identity's tags with that pod's namespace, service account, name
and UID (moto does not echo tags: the proxy's record of the call says what STS received).
"""
from __future__ import annotations

import secrets

import boto3
import pytest
from test_container_credentials import Node

from kiamfast.testing.sts import FaultProxy

pytestmark = pytest.mark.kube_apiserver

CLUSTER = "ci-1"


@pytest.fixture(scope="module")
def tagged(cluster, peers, tmp_path_factory):
    with FaultProxy(peers.sts.url) as proxy:
        n = Node(cluster, peers, tmp_path_factory.mktemp("agent"),
                 lambda prefix: f"{prefix}-{secrets.token_hex(3)}",
                 extra=(f"--sts-endpoint={proxy.url}", "--session-tags",
                        "--session-tag-keys=eks", f"--cluster-name={CLUSTER}"))
        try:
            yield n, proxy
        finally:
            n.agent.stop()


def caller_arn(sts_url: str, body: dict) -> str:
    return boto3.client(
        "sts", region_name="us-east-1", endpoint_url=sts_url,
        aws_access_key_id=body["AccessKeyId"], aws_secret_access_key=body["SecretAccessKey"],
        aws_session_token=body["Token"]).get_caller_identity()["Arn"]


def test_each_pod_gets_a_session_of_its_own_tagged_as_eks_tags_it(tagged):
    node, proxy = tagged
    pods = {name: node.pod(name, role="role-a") for name in ("tag-web-0", "tag-web-1")}
    keys = set()
    for name, uid in pods.items():
        status, body = node.answered(node.token(name, uid))
        assert status == 200, body
        keys.add(body["AccessKeyId"])
        session = f"eks-{CLUSTER}-{name}-{uid.replace('-', '')[:8]}"
        assert caller_arn(node.sts_url, body) == (
            f"arn:aws:sts::123456789012:assumed-role/role-a/{session}")
        (call,) = [c for c in proxy.assume_role_calls(outcome="ok")
                   if c.access_key_id == body["AccessKeyId"]]
        assert call.session_name == session
        assert call.tags == {"eks-cluster-name": CLUSTER, "kubernetes-namespace": node.ns,
                             "kubernetes-service-account": "app",
                             "kubernetes-pod-name": name, "kubernetes-pod-uid": uid}
    assert len(keys) == 2                  # two pods of one role: two sessions


def test_sts_refusing_the_tags_is_a_403_that_names_tagsession(tagged):
    """moto does not evaluate trust policies: the proxy answers STS's own AccessDenied
    document for this role instead of forwarding the call."""
    node, proxy = tagged
    proxy.add_fault("deny", roles=["arn:aws:iam::123456789012:role/role-b"])
    uid = node.pod("tag-refused", role="role-b")
    status, body = node.answered(node.token("tag-refused", uid))
    assert (status, body["Code"]) == (403, "AccessDenied"), body
    assert "sts:TagSession" in body["Message"], body
    calls = proxy.assume_role_calls("arn:aws:iam::123456789012:role/role-b")
    assert calls and all(c.tags.get("kubernetes-pod-uid") == uid for c in calls)
