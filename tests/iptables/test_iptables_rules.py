"""The DNAT rule, installed for real in network namespaces this test creates.

What a user checks on a node: ``iptables -t nat -S PREROUTING`` shows kube2iam's rule exactly
once however often the agent starts, removal leaves nothing behind, a wrong interface is a
clear error, and a connection from a pod to 169.254.169.254:80 lands on the agent's port with
the pod's own source address (the agent identifies pods by it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

from kiamfast.config import Config
from kiamfast.iptables import runner
from kiamfast.iptables import rules
from kiamfast.iptables.runner import InterfaceNotFound, IptablesError, IptablesNotFound
from kiamfast.iptables.rules import Rule
from needs import missing_tool, not_root_reason

# --------------------------------------------------------------------------------------------
# Pure argv builders (no root needed)
# --------------------------------------------------------------------------------------------


def test_rule_spec_is_kube2iams_rule():
    rule = Rule("169.254.169.254", "10.0.0.7", 8181, "eni+")
    assert str(rule) == ("iptables -t nat -A PREROUTING -p tcp -d 169.254.169.254 --dport 80 "
                         "-j DNAT --to-destination 10.0.0.7:8181 -i eni+")
    assert runner.command("-C", rule) == [
        "iptables", "-w", "5", "-t", "nat", "-C", "PREROUTING", "-p", "tcp", "-d",
        "169.254.169.254", "--dport", "80", "-j", "DNAT", "--to-destination",
        "10.0.0.7:8181", "-i", "eni+"]


def test_negated_interface_and_ipv6_and_prefixes():
    rule = Rule("fd00:ec2::254", "fd00:1::1", 8181, "!eth0", family=6)
    argv = runner.command("-A", rule, backend="legacy", netns="kf-x")
    assert argv[:5] == ["ip", "netns", "exec", "kf-x", "ip6tables-legacy"]
    assert argv[-5:] == ["--to-destination", "[fd00:1::1]:8181", "!", "-i", "eth0"]
    assert rules.saved_form(rule) == (
        "-A PREROUTING -d fd00:ec2::254/128 ! -i eth0 -p tcp -m tcp --dport 80 -j DNAT "
        "--to-destination [fd00:1::1]:8181")
    with pytest.raises(ValueError):
        runner.command("-F", rule)


def test_rules_for_config():
    cfg = Config(iptables=True, host_ip="10.0.0.7", host_interface="cali+", app_port=8282,
                 metadata_addr="169.254.169.254:80")
    assert rules.rules_for_config(cfg) == [
        Rule("169.254.169.254", "10.0.0.7", 8282, "cali+", 4)]
    both = cfg.replace(metadata_ipv6=True, host_ipv6="fd00:1::7")
    assert [r.family for r in rules.rules_for_config(both)] == [4, 6]
    assert rules.rules_for_config(both)[1].host_ip == "fd00:1::7"
    # No IPv6 address known: the IPv6 rule is skipped, the IPv4 one stays.
    assert len(rules.rules_for_config(cfg.replace(metadata_ipv6=True))) == 1
    v6_only = Config(iptables=True, host_ip="fd00:1::7", host_interface="eni+")
    with pytest.raises(IptablesError, match="IPv6"):
        rules.rules_for_config(v6_only)
    assert rules.rules_for_config(v6_only.replace(metadata_ipv6=True)) == [
        Rule("fd00:ec2::254", "fd00:1::7", 8181, "eni+", 6)]


# --------------------------------------------------------------------------------------------
# Real iptables in network namespaces
# --------------------------------------------------------------------------------------------

def _skip_reason() -> str | None:
    return (not_root_reason("network namespaces") or missing_tool("iptables", "ip6tables", "ip"))


needs_root = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


@pytest.fixture
def netns():
    """Network namespaces created for one test and always deleted afterwards."""
    created: list[str] = []

    def make() -> str:
        name = f"kf-ipt-{uuid.uuid4().hex[:10]}"
        sh("ip", "netns", "add", name)
        created.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    try:
        yield make
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def nat_rules(ns: str, binary: str = "iptables") -> list[str]:
    out = sh("ip", "netns", "exec", ns, binary, "-w", "5", "-t", "nat", "-S", "PREROUTING")
    return [line for line in out.stdout.splitlines() if line.startswith("-A ")]


def backends() -> list[str | None]:
    found: list[str | None] = [None]
    found += [b for b in ("nft", "legacy") if shutil.which(f"iptables-{b}")]
    return found


@pytest.mark.root
@needs_root
@pytest.mark.parametrize("backend", backends(), ids=lambda b: b or "default")
def test_ensure_is_idempotent_and_exact(netns, backend):
    ns = netns()
    binary = f"iptables-{backend}" if backend else "iptables"
    rule = Rule("169.254.169.254", "10.213.0.1", 8181, "eni+")
    assert not runner.rule_present(rule, backend=backend, netns=ns)
    assert runner.ensure_rule(rule, backend=backend, netns=ns) is True
    assert runner.ensure_rule(rule, backend=backend, netns=ns) is False
    assert runner.rule_present(rule, backend=backend, netns=ns)
    assert nat_rules(ns, binary) == [
        "-A PREROUTING -d 169.254.169.254/32 -i eni+ -p tcp -m tcp --dport 80 -j DNAT "
        "--to-destination 10.213.0.1:8181"]
    assert nat_rules(ns, binary) == [rules.saved_form(rule)]
    # A second copy (say, left by kube2iam and then added by hand) is removed too.
    sh("ip", "netns", "exec", ns, *runner.command("-A", rule, backend=backend)[0:],
       check=True)
    assert len(nat_rules(ns, binary)) == 2
    assert runner.remove_rule(rule, backend=backend, netns=ns) == 2
    assert nat_rules(ns, binary) == []
    assert runner.remove_rule(rule, backend=backend, netns=ns) == 0


@pytest.mark.root
@needs_root
def test_other_rules_are_left_alone(netns):
    ns = netns()
    other = Rule("169.254.169.254", "10.213.0.9", 9999, "cni0")
    ours = Rule("169.254.169.254", "10.213.0.1", 8181, "cni0")
    runner.ensure_rule(other, netns=ns)
    runner.ensure_rule(ours, netns=ns)
    runner.remove_rule(ours, netns=ns)
    assert nat_rules(ns) == [rules.saved_form(other)]


@pytest.mark.root
@needs_root
def test_install_rules_from_config_wildcard_negated_and_ipv6(netns):
    ns = netns()
    cfg = Config(iptables=True, host_ip="10.213.0.1", host_interface="!eth0",
                 metadata_ipv6=True, host_ipv6="fd00:213::1", iptables_backend="auto")
    installed = runner.install_rules(cfg, netns=ns)
    runner.install_rules(cfg, netns=ns)
    assert nat_rules(ns) == [
        "-A PREROUTING -d 169.254.169.254/32 ! -i eth0 -p tcp -m tcp --dport 80 -j DNAT "
        "--to-destination 10.213.0.1:8181"]
    assert nat_rules(ns, "ip6tables") == [
        "-A PREROUTING -d fd00:ec2::254/128 ! -i eth0 -p tcp -m tcp --dport 80 -j DNAT "
        "--to-destination [fd00:213::1]:8181"]
    assert len(installed) == 2
    assert runner.remove_rules(cfg, netns=ns) == 2
    assert nat_rules(ns) == [] and nat_rules(ns, "ip6tables") == []

    wildcard = cfg.replace(host_interface="veth+", metadata_ipv6=False)
    runner.install_rules(wildcard, netns=ns)  # no veth exists: a wildcard is not checked
    assert nat_rules(ns) == [rules.saved_form(rules.rules_for_config(wildcard)[0])]


@pytest.mark.root
@needs_root
def test_missing_interface_is_a_clear_error(netns):
    ns = netns()
    cfg = Config(iptables=True, host_ip="10.213.0.1", host_interface="docker0")
    with pytest.raises(InterfaceNotFound, match='"docker0" does not exist'):
        runner.install_rules(cfg, netns=ns)
    assert nat_rules(ns) == []
    runner.check_interface("lo", netns=ns)
    runner.check_interface("lo")  # our own namespace, no subprocess
    with pytest.raises(InterfaceNotFound):
        runner.check_interface("kf-no-such0")


@pytest.mark.root
@needs_root
def test_missing_binary_is_not_mistaken_for_an_absent_rule(netns, tmp_path, monkeypatch):
    ns = netns()
    rule = Rule("169.254.169.254", "10.213.0.1", 8181, "eni+")
    # A PATH with `ip` but no iptables: `ip netns exec` then exits 1, like "rule absent".
    (tmp_path / "ip").symlink_to(shutil.which("ip"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(IptablesNotFound, match="iptables"):
        runner.rule_present(rule, netns=ns)
    with pytest.raises(IptablesNotFound, match="not found on PATH"):
        runner.ensure_rule(rule)


@pytest.mark.root
@needs_root
def test_iptables_error_carries_the_message(netns):
    ns = netns()
    bad = Rule("169.254.169.254", "10.213.0.1", 8181, "much-too-long-interface-name")
    with pytest.raises(IptablesError, match="failed"):
        runner.ensure_rule(bad, netns=ns)


# --------------------------------------------------------------------------------------------
# Real traffic: pod namespace -> veth -> node namespace with the rule -> server on host-ip
# --------------------------------------------------------------------------------------------

SERVER = textwrap.dedent("""
    import socket, sys
    family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2])))
    s.listen(1)
    print("listening", flush=True)
    s.settimeout(20)
    conn, peer = s.accept()
    conn.sendall(("peer=" + peer[0] + " local=" + conn.getsockname()[0]).encode())
    conn.close()
""")

CLIENT = textwrap.dedent("""
    import socket, sys
    family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
    s = socket.create_connection((sys.argv[1], 80), timeout=10)
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    print(data.decode())
""")


def _connect_through_rule(netns, *, family: int) -> str:
    pod, node = netns(), netns()
    veth_pod, veth_node = f"kfp{uuid.uuid4().hex[:8]}", f"kfn{uuid.uuid4().hex[:8]}"
    sh("ip", "link", "add", veth_pod, "netns", pod, "type", "veth", "peer", "name", veth_node,
       "netns", node)
    if family == 4:
        pod_ip, node_ip, metadata = "10.213.7.2", "10.213.7.1", "169.254.169.254"
        sh("ip", "-n", pod, "addr", "add", f"{pod_ip}/24", "dev", veth_pod)
        sh("ip", "-n", node, "addr", "add", f"{node_ip}/24", "dev", veth_node)
    else:
        pod_ip, node_ip, metadata = "fd00:213:7::2", "fd00:213:7::1", "fd00:ec2::254"
        sh("ip", "-n", pod, "addr", "add", f"{pod_ip}/64", "dev", veth_pod, "nodad")
        sh("ip", "-n", node, "addr", "add", f"{node_ip}/64", "dev", veth_node, "nodad")
    sh("ip", "-n", pod, "link", "set", veth_pod, "up")
    sh("ip", "-n", node, "link", "set", veth_node, "up")
    sh("ip", "-n", pod, "route", "add", metadata, "via", node_ip)

    cfg = Config(iptables=True, host_ip="10.213.7.1", host_interface=veth_node,
                 app_port=8181, metadata_ipv6=family == 6, host_ipv6="fd00:213:7::1")
    rules = runner.install_rules(cfg, netns=node)
    assert [r.family for r in rules] == ([4, 6] if family == 6 else [4])

    server = subprocess.Popen(
        ["ip", "netns", "exec", node, sys.executable, "-c", SERVER, node_ip, "8181"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        client = sh("ip", "netns", "exec", pod, sys.executable, "-c", CLIENT, metadata)
        server.wait(timeout=20)
        return client.stdout.strip()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.root
@needs_root
def test_pod_traffic_to_metadata_reaches_the_agent_with_the_pod_address(netns):
    reply = _connect_through_rule(netns, family=4)
    assert reply == "peer=10.213.7.2 local=10.213.7.1"


@pytest.mark.root
@needs_root
def test_ipv6_metadata_traffic_reaches_the_agent(netns):
    reply = _connect_through_rule(netns, family=6)
    assert reply == "peer=fd00:213:7::2 local=fd00:213:7::1"
