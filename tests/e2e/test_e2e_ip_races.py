"""The kube2iam failures around pod IPs, end to end: a real containerd, a real SDK in the pod.

The API server learns a pod's address seconds after its sandbox is up, and it keeps a dead
pod Running with its address after the address went to a new sandbox (reference: cri.md).
Here the pods are real sandboxes on the node's containerd and the API server emulator is
exactly that late:

1. A pod asks before its IP has reached the API server (kube2iam: the default role or a
   404 after a blind retry). The agent asks the runtime, which knows the address from CNI,
   and the pod's first SDK call returns its own role.
2. An IP is reused (host-local forced to hand out the same address) while the API still
   shows the old pod Running with it, and the old pod's delete arrives late. The new pod
   never gets the old pod's role, and the late delete changes nothing for it.

The judge is STS: a key counts as the pod's only if STS issued it for the pod's role.
"""

from __future__ import annotations

import time

import pytest

from e2e_cluster import wrong_answers

pytestmark = pytest.mark.root


def role_of(node, creds: dict) -> str | None:
    return node.sts.role_of(creds.get("AccessKeyId"))


def test_first_sdk_call_before_the_api_server_knows_the_pod_ip(runtime_node):
    node = runtime_node
    agent = node.start_agent()
    pod = node.add_pod("early", role="role-early")
    assert node.api.pods.get("default", "early")["status"].get("podIP") is None

    creds = pod.botocore_credentials()
    assert "AccessKeyId" in creds, f"first SDK call failed: {creds}\n" + agent.log()
    assert role_of(node, creds) == "role-early", creds
    assert ":assumed-role/role-early/" in creds["Arn"], creds

    # The API server catches up; nothing changes for the pod.
    node.publish_ip(pod)
    again = pod.fetch()
    assert again.ok and again.access_key == creds["AccessKeyId"], again
    assert node.imds_credential_requests() == []


def test_reused_ip_with_a_late_delete_of_the_old_pod(runtime_node):
    node = runtime_node
    agent = node.start_agent()
    reused = "10.88.0.51"
    node.containerd.set_range(reused, reused)
    old = node.add_pod("old", role="role-old", ip_in_api=True)
    first = old.wait_credentials()
    assert old.ip == reused and first.ok and first.role == "role-old", f"{first}\n" + agent.log()

    # The old pod's sandbox is gone and its IP handed to a new sandbox; the API server still
    # lists the old pod as Running with that IP and has no address for the new one yet.
    node.remove_sandbox(old)
    new = node.add_pod("new", role="role-new")
    assert new.ip == reused, new.sandbox
    assert node.api.pods.get("default", "old")["status"]["podIP"] == reused
    assert node.api.pods.get("default", "new")["status"].get("podIP") is None

    early = new.prober(interval=0.02).start()
    creds = new.botocore_credentials()
    assert "AccessKeyId" in creds, f"{creds}\n" + agent.log()
    assert role_of(node, creds) == "role-new", creds
    assert ":assumed-role/role-new/" in creds["Arn"], creds
    before = early.stop()

    # The late delete of the old pod arrives, then the new pod's address.
    late = new.prober(interval=0.03).start()
    node.api.pods.delete("default", "old")
    node.publish_ip(new)
    time.sleep(1.0)
    during = late.stop()
    after = new.botocore_credentials()

    assert before and wrong_answers(new, before) == [], wrong_answers(new, before)[:10]
    assert during and all(s.ok and s.role == "role-new" for s in during), \
        [s for s in during if not (s.ok and s.role == "role-new")][:10]
    assert role_of(node, after) == "role-new", after
    assert after["AccessKeyId"] == creds["AccessKeyId"], "credentials changed for no reason"
    assert node.imds_credential_requests() == []
