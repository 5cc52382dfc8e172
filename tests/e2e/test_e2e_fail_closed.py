"""Without its agent, a pod gets a refused connection, never the node's role.

The agent leaves its DNAT rule in place when it stops (``--iptables-remove-on-exit`` is off
by default): pods' metadata traffic still goes to the agent's port, where nothing listens,
so the SDK fails with "no credentials". Removing the rule would hand every pod on the node
the node's own role from the real metadata service (test_e2e_harness shows that happens
here too when no rule is there).
"""

from __future__ import annotations

import signal

import pytest

pytestmark = pytest.mark.root


def test_stopped_agent_leaves_pods_refused_never_the_nodes_role(node):
    agent = node.start_agent()
    pod = node.add_pod("app", "10.77.0.70", role="role-app")
    assert pod.wait_credentials().ok
    rules = node.dnat_rules()
    assert len(rules) == 1, rules

    code = agent.stop(sig=signal.SIGTERM)
    assert code == 0, f"agent exited with {code} on SIGTERM\n" + agent.log()
    assert agent.children() == {}
    assert node.dnat_rules() == rules, "the DNAT rule did not survive the agent"

    sample = pod.fetch()
    assert sample.status == 0 and "ConnectionRefused" in (sample.error or ""), sample
    creds = pod.botocore_credentials(who_am_i=False)
    assert (creds.get("error"), creds.get("exit")) == ("no credentials", 3), creds
    assert node.imds_credential_requests() == []
