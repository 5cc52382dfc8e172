"""The harness itself: what the other end-to-end tests rely on, checked without an agent.

If these fail, every other result in this directory means nothing. Above all: without the
agent a pod *does* reach the node's metadata service and gets the node's role. That is the
leak the agent exists to prevent, and it shows the tests can see it when it happens.
"""

from __future__ import annotations

import subprocess

import pytest

from e2e_cluster import NODE_ACCESS_KEY_PREFIX, Node

pytestmark = pytest.mark.root


def test_without_agent_a_pod_gets_the_nodes_role(node):
    pod = node.add_pod("app", "10.77.0.10", role="app-role")
    creds = pod.botocore_credentials(who_am_i=False)
    assert creds.get("AccessKeyId", "").startswith(NODE_ACCESS_KEY_PREFIX), creds
    assert node.imds_credential_requests(), "the fake IMDS saw no credential request"
    assert {r.client for r in node.imds.requests} == {"10.77.0.10"}


def test_a_pod_ip_can_be_reused(node):
    first = node.add_pod("first", "10.77.0.11")
    assert first.fetch().ok
    node.remove_pod_net(first)
    second = node.add_pod("second", "10.77.0.11")
    assert second.fetch().ok
    assert [r.client for r in node.imds.requests][-1] == "10.77.0.11"


def test_close_removes_every_namespace(tmp_path):
    n = Node(tmp_path / "n")
    names = [n.name, n.add_pod("a", "10.77.0.2").net.ns.name,
             n.add_pod("b", "10.77.0.3").net.ns.name]
    n.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in names if name in listed]
