"""The DNAT rule stays through a kube2iam pod's preStop hook: a pod never reaches the node's
metadata service (issue 33, "never fail open").

kube2iam's newest chart (values.yaml `lifecycle.preStop`) runs, when its pod stops,

    /bin/sh -c "eval `iptables-save | grep 169.254.169.254 | sed s/-A/'iptables -t nat -D'/g`"

which deletes every nat rule naming the metadata address: kiamfast's too, where it is the only
such line (the backquotes are not quoted, so several lines are joined into one malformed
command that deletes nothing).  Here the exact command runs in the node's namespace, with the
host's iptables, while pods ask all along through the DNAT; the fake metadata service hands
out the node's role (keys ASIANODE...) and records every request.

* Today's agent (the rule installed once, no backstop) loses its rule for good: pods get the
  node's role.  That is the failure.
* With --iptables-check-interval the agent puts the rule back within milliseconds (nft
  announces the deletion on netlink); without the backstop a pod asking in that window can
  still reach the node's service.
* With --iptables-backstop a filter-table rule resets the connections no DNAT redirected:
  the same window costs a pod a refused call, never the node's role; and the backstop's own
  line makes the exact preStop a malformed command that deletes nothing.
"""
from __future__ import annotations

import time

import pytest

from e2e_cluster import wrong_answers

pytestmark = pytest.mark.root

PRESTOP = ("eval `iptables-save | grep 169.254.169.254 | sed s/-A/'iptables -t nat -D'/g`")
# The same deletions one line at a time: what the hook would do if its author had quoted the
# substitution.  It removes the DNAT rule even beside the backstop's line (which it cannot
# delete: there is no FORWARD or INPUT chain in the nat table).
PRESTOP_LINE_BY_LINE = ("iptables-save | grep 169.254.169.254 | "
                        "sed s/-A/'iptables -t nat -D'/g | while read -r cmd; do eval $cmd; done")

KEEP = ["--iptables-check-interval=1s"]
BACKSTOP = ["--iptables-backstop"]


def run_prestop(node, script: str):
    return node.net.ns.run(["/bin/sh", "-c", script], timeout=30)


def dnat_back_after(node, *, timeout: float = 10.0) -> float:
    """Seconds until the node has a DNAT rule for the metadata address again."""
    started = time.monotonic()
    while not node.dnat_rules():
        assert time.monotonic() - started < timeout, "the DNAT rule never came back"
        time.sleep(0.002)
    return time.monotonic() - started


def asking(node, pod):
    return pod.prober(interval=0.005).start()


def leaked(samples):
    return [s for s in samples if s.access_key and s.access_key.startswith("ASIANODE")]


def test_today_the_prestop_hands_pods_the_nodes_role(node):
    node.start_agent()
    pod = node.add_pod("app", "10.77.0.70", role="role-app")
    assert pod.wait_credentials().ok
    assert len(node.dnat_rules()) == 1
    assert run_prestop(node, PRESTOP).returncode == 0
    assert node.dnat_rules() == []
    time.sleep(2)                                   # nothing puts it back
    assert node.dnat_rules() == []
    sample = pod.fetch()
    assert sample.access_key and sample.access_key.startswith("ASIANODE"), sample
    assert node.imds_credential_requests() != []


def test_the_agent_puts_its_rule_back_within_milliseconds(node):
    agent = node.start_agent(extra_args=KEEP)
    pod = node.add_pod("app", "10.77.0.70", role="role-app")
    assert pod.wait_credentials().ok
    prober = asking(node, pod)
    time.sleep(0.3)
    assert run_prestop(node, PRESTOP).returncode == 0
    back = dnat_back_after(node)
    time.sleep(0.3)
    samples = prober.stop()
    print(f"DNAT rule back {back * 1000:.1f} ms after the preStop returned; "
          f"{len(leaked(samples))} of {len(samples)} calls reached the node's service")
    assert back < 1.0, agent.log()
    assert "put back" in agent.log()
    assert len(node.dnat_rules()) == 1
    assert pod.fetch().ok


@pytest.mark.parametrize("script", [PRESTOP, PRESTOP_LINE_BY_LINE],
                         ids=["exact-prestop", "line-by-line"])
def test_with_the_backstop_no_call_ever_reaches_the_nodes_service(node, script):
    agent = node.start_agent(extra_args=[*KEEP, *BACKSTOP])
    pod = node.add_pod("app", "10.77.0.70", role="role-app")
    assert pod.wait_credentials().ok
    saved = node.net.ns.iptables_save("filter")
    assert saved.count("kiamfast: metadata traffic not redirected") == 2, saved  # INPUT, FORWARD
    prober = asking(node, pod)
    time.sleep(0.3)
    done = run_prestop(node, script)
    back = dnat_back_after(node)
    for _ in range(3):                               # again and again, as more pods stop
        run_prestop(node, script)
        dnat_back_after(node)
    time.sleep(0.3)
    samples = prober.stop()
    if script == PRESTOP:
        # the backstop's lines join the DNAT's into one malformed command: nothing deleted
        assert done.returncode != 0 and "Bad argument" in done.stderr, done
        assert "put back" not in agent.log()
    else:
        assert "put back" in agent.log(), agent.log()
    print(f"{script[:20]!r}: DNAT back within {back * 1000:.1f} ms; outcomes "
          f"{sorted({(s.status, (s.error or '')[:30]) for s in samples})}")
    assert leaked(samples) == []
    assert node.imds_credential_requests() == []
    # refused (reset by the backstop) at worst, never another role
    assert wrong_answers(pod, samples, allowed_errors=(0,)) == []
    assert pod.fetch().ok


def test_the_backstop_leaves_the_agents_own_passthrough_alone(node):
    node.start_agent(extra_args=[*KEEP, *BACKSTOP])
    pod = node.add_pod("app", "10.77.0.70", role="role-app")
    assert pod.wait_credentials().ok
    # a path the agent passes through to the node's metadata service (from the node itself)
    status, body = node.http("GET", "/latest/meta-data/instance-id", host="169.254.169.254",
                             port=80)
    assert status == 200 and body, (status, body)
    # and a pod's non-credential request through the agent's passthrough
    status, _ = pod_get(pod, "/latest/meta-data/instance-id")
    assert status == 200


def pod_get(pod, path: str):
    import http.client
    from netns import call_in_netns

    def go():
        conn = http.client.HTTPConnection("169.254.169.254", 80, timeout=2)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()
    return call_in_netns(pod.net.ns, go)
