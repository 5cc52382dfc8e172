"""The kube2iam failures around pod IPs, end to end with a real SDK in the pod.

1. A pod asks before its IP has reached the API server (kube2iam: the default role or a 404
   after a blind retry). The kubelet already knows the IP; the agent asks it, within the
   SDK's budget, and the pod's first call returns its own role.
2. An IP is reused and the old pod's delete arrives late. The new pod gets its own role at
   once, and the late delete of the old pod changes nothing for the new one.
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.root


def role_of(node, creds: dict) -> str | None:
    return node.sts.role_of(creds.get("AccessKeyId"))


def test_first_sdk_call_before_the_api_server_knows_the_pod_ip(node):
    agent = node.start_agent()
    pod = node.add_pod("early", "10.77.0.50", role="role-early", ip_in_api=False)
    assert node.api.get_pod("default", "early")["status"].get("podIP") is None

    node.api.reset_stats()
    creds = pod.botocore_credentials()
    assert "AccessKeyId" in creds, f"first SDK call failed: {creds}\n" + agent.log()
    assert role_of(node, creds) == "role-early", creds
    assert ":assumed-role/role-early/" in creds["Arn"], creds
    assert node.api.stats()["kubelet_requests"] > 0, "the agent never asked the kubelet"

    # The API server catches up; nothing changes for the pod.
    node.api.set_pod_ips("default", "early", [pod.ip])
    node.api.set_pod_phase("default", "early", "Running")
    again = pod.fetch()
    assert again.ok and role_of(node, {"AccessKeyId": again.access_key}) == "role-early"
    assert node.imds_credential_requests() == []


def test_reused_ip_with_a_late_delete_of_the_old_pod(node):
    agent = node.start_agent()
    old = node.add_pod("old", "10.77.0.51", role="role-old")
    first = old.wait_credentials()
    assert first.ok and first.role == "role-old", f"{first}\n" + agent.log()

    # The old pod's sandbox is gone, its IP handed to a new pod; the API server still
    # lists the old pod as Running with that IP (its delete has not been seen yet).
    node.remove_pod_net(old)
    new = node.add_pod("new", "10.77.0.51", role="role-new")
    assert node.api.get_pod("default", "old")["status"]["podIP"] == "10.77.0.51"

    creds = new.botocore_credentials()
    assert "AccessKeyId" in creds, f"{creds}\n" + agent.log()
    assert role_of(node, creds) == "role-new", creds
    assert ":assumed-role/role-new/" in creds["Arn"], creds

    # The late delete of the old pod arrives.
    prober = new.prober(interval=0.03).start()
    node.api.delete_pod("default", "old")
    time.sleep(1.0)
    samples = prober.stop()
    after = new.botocore_credentials()

    assert samples and all(s.ok and s.role == "role-new" for s in samples), \
        [s for s in samples if not (s.ok and s.role == "role-new")][:10]
    assert role_of(node, after) == "role-new", after
    assert after["AccessKeyId"] == creds["AccessKeyId"], "credentials changed for no reason"
    assert node.imds_credential_requests() == []
