"""The container-credentials addresses on the node, as a pod reaches them.

The agent runs in the node namespace with ``--container-credentials-addr=169.254.170.23:80,
[fd00:ec2::23]:80 --container-credentials-link=kiamfast0``, as the chart starts it; a pod
namespace behind the node's bridge asks ``http://169.254.170.23/v1/credentials`` and
``http://[fd00:ec2::23]/v1/credentials`` through its default routes. No token is sent: the
agent's own JSON refusal (400 InvalidToken) proves the path, the link and the listener; the
token checks themselves are tests/podidentity's.

What a user checks: the pod gets the agent's answer on both addresses; the agent restarted
(SIGKILLed, started again) finds the link and its addresses and says so; after the agent
stops, a connection is refused at once (the addresses stay: never a timeout, never another
host's answer); with IPv6 disabled on the node the agent serves IPv4 and logs why not IPv6.
"""
from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time

import pytest
from netns import call_in_netns

pytestmark = pytest.mark.root

LINK = "kiamfast0"
V4, V6 = "169.254.170.23", "fd00:ec2::23"
FLAGS = [f"--container-credentials-addr={V4}:80,[{V6}]:80",
         f"--container-credentials-link={LINK}"]
# An IPv6 subnet on the node's bridge, so a pod has an IPv6 default route to the node.
NODE_V6, POD_V6 = "fd00:77::1", "fd00:77::10"


def _ip(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True,
                          text=True, timeout=20).stdout


def give_ipv6(node, pod) -> None:
    """The bridge and the pod get IPv6 addresses; the pod's IPv6 default route is the node."""
    _ip(node.name, "addr", "add", f"{NODE_V6}/64", "dev", "kfbr0", "nodad")
    _ip(pod.net.ns.name, "addr", "add", f"{POD_V6}/64", "dev", "eth0", "nodad")
    _ip(pod.net.ns.name, "-6", "route", "add", "default", "via", NODE_V6)


def ask(pod, host: str) -> tuple[int, dict]:
    """GET /v1/credentials from inside the pod, no Authorization header."""
    def go() -> tuple[int, dict]:
        conn = http.client.HTTPConnection(host, 80, timeout=5)
        try:
            conn.request("GET", "/v1/credentials")
            resp = conn.getresponse()
            assert resp.getheader("Content-Type") == "application/json"
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()
    return call_in_netns(pod.net.ns, go)


def connect_error(pod, host: str) -> type[BaseException] | None:
    """The exception a TCP connect from the pod to host:80 ends with (None: it connected)."""
    def go():
        try:
            socket.create_connection((host, 80), timeout=5).close()
        except OSError as e:
            return type(e)
        return None
    return call_in_netns(pod.net.ns, go)


def refused_once_closed(pod, host: str, settle: float = 2.0) -> type[BaseException] | None:
    """What a connect ends with once the dead agent's listener is closed.  An exiting
    process can leave the namespace's process list a moment before the kernel has closed
    its sockets (seen here: one connect in a few still succeeded right after), so a
    connect may succeed for that moment.  Wait out only that, never a timeout."""
    deadline = time.monotonic() + settle
    while True:
        error = connect_error(pod, host)
        if error is not None or time.monotonic() > deadline:
            return error
        time.sleep(0.05)


def link_state(node) -> tuple[int, str, set[str]]:
    """(ifindex, kind, addresses) of the agent's link in the node namespace."""
    shown = json.loads(_ip(node.name, "-j", "-d", "addr", "show", "dev", LINK))[0]
    return (shown["ifindex"], shown["linkinfo"]["info_kind"],
            {a["local"] for a in shown.get("addr_info", ())})


def wait_agent_gone(node, timeout: float = 10.0) -> None:
    """Until no process runs in the node namespace: a SIGKILLed child closes its sockets
    only once the kernel has finished it, a moment after the supervisor is reaped."""
    deadline = time.monotonic() + timeout
    while node.net.ns.pids():
        assert time.monotonic() < deadline, f"still running: {node.net.ns.pids()}"
        time.sleep(0.02)


def kernel_has_dummy(node) -> bool:
    probe = "kfdummyprobe"
    made = subprocess.run(["ip", "-n", node.name, "link", "add", probe, "type", "dummy"],
                          capture_output=True, text=True)
    if made.returncode == 0:
        _ip(node.name, "link", "del", probe)
    return made.returncode == 0


def assert_agent_answers(pod, host: str) -> None:
    status, body = ask(pod, host)
    assert status == 400, body
    assert body["Code"] == "InvalidToken", body
    assert body["Message"]


def test_pod_reaches_both_addresses_across_a_restart_and_is_refused_after_stop(node):
    pod = node.add_pod("app", "10.77.0.10", role="app-role")
    give_ipv6(node, pod)
    agent = node.start_agent(extra_args=FLAGS)

    assert_agent_answers(pod, V4)
    assert_agent_answers(pod, V6)
    index, kind, addresses = link_state(node)
    assert {V4, V6} <= addresses
    # A dummy link where the kernel has them; a bridge without ports where it has not.
    assert kind == ("dummy" if kernel_has_dummy(node) else "bridge")
    # The pod's packets to 169.254.170.23 are delivered locally, not caught by the IMDS DNAT.
    nat = node.net.ns.iptables_save("nat")
    assert node.dnat_rules() and "169.254.170" not in nat and "fd00:ec2" not in nat

    agent.kill()     # an OOM kill: nothing cleans up
    logged = len(agent.log(tail=10**9))
    wait_agent_gone(node)
    assert link_state(node) == (index, kind, addresses)   # kept
    assert refused_once_closed(pod, V4) is ConnectionRefusedError
    assert refused_once_closed(pod, V6) is ConnectionRefusedError

    agent.start()
    agent.wait_ready()
    assert_agent_answers(pod, V4)
    assert_agent_answers(pod, V6)
    assert link_state(node) == (index, kind, addresses)   # reused, nothing added twice
    restarted = agent.log(tail=10**9)[logged:]
    assert f"{LINK} already holds {V4}" in restarted and f"{LINK} already holds {V6}" in restarted
    assert "added " not in restarted and "cannot start" not in restarted, restarted

    assert agent.stop() == 0
    wait_agent_gone(node)
    assert link_state(node) == (index, kind, addresses)   # kept on a clean stop too
    assert refused_once_closed(pod, V4) is ConnectionRefusedError
    assert refused_once_closed(pod, V6) is ConnectionRefusedError


def test_ipv6_disabled_on_the_node_serves_ipv4_and_says_why_not_ipv6(node):
    subprocess.run(["ip", "netns", "exec", node.name, "sysctl", "-qw",
                    "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1"], check=True, timeout=20)
    pod = node.add_pod("app", "10.77.0.10", role="app-role")
    agent = node.start_agent(extra_args=FLAGS)

    assert_agent_answers(pod, V4)
    _, _, addresses = link_state(node)
    assert addresses == {V4}
    lines = [line for line in agent.log().splitlines()
             if f"not serving container credentials on [{V6}]" in line]
    assert len(lines) == 1, agent.log()
    assert "IPv6 disabled" in lines[0]
    assert agent.running() and len(agent.children()) == 2   # control + one worker, no loop


def test_without_net_admin_the_agent_exits_with_one_line_naming_the_flag(node):
    """No CAP_NET_ADMIN (a chart without it): the IPv4 address cannot be added, and the
    honest answer is to exit (the DaemonSet restarts it), not to run without the listener."""
    no_net_admin = ["setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin"]
    agent = node.start_agent(extra_args=FLAGS, wrapper=no_net_admin, wait_ready=False)
    assert agent.proc.wait(30) == 1
    errors = [line for line in agent.log().splitlines() if " error " in line]
    assert len(errors) == 1, agent.log()
    assert "cannot start: --container-credentials-link=kiamfast0:" in errors[0]
    assert "Operation not permitted" in errors[0]
    assert "Traceback" not in agent.log()
    missing = subprocess.run(["ip", "-n", node.name, "link", "show", "dev", LINK],
                             capture_output=True, text=True)
    assert missing.returncode != 0      # nothing half made
