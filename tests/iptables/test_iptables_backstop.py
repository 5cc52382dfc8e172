"""The backstop rule and the rule keeper's argv (pure: no root needed).

The real rules in network namespaces, kube2iam's preStop hook and the pods' view of them:
tests/e2e/test_e2e_dnat_kept.py.
"""
from __future__ import annotations

from kiamfast.config import Config
from kiamfast.iptables import runner
from kiamfast.iptables import rules
from kiamfast.iptables.rules import BackstopRule, Rule


def test_the_backstop_resets_what_no_dnat_redirected_in_the_filter_table():
    rule = BackstopRule("169.254.169.254", "cni0", "FORWARD")
    assert runner.command("-I", rule) == [
        "iptables", "-w", "5", "-t", "filter", "-I", "FORWARD", "1", "-p", "tcp", "-d",
        "169.254.169.254", "--dport", "80", "-i", "cni0", "-m", "comment", "--comment",
        "kiamfast: metadata traffic not redirected to the agent", "-j", "REJECT",
        "--reject-with", "tcp-reset"]
    assert runner.command("-C", rule)[4:7] == ["filter", "-C", "FORWARD"]


def test_backstops_for_config():
    cfg = Config(iptables=True, host_ip="10.0.0.7", host_interface="cali+")
    assert rules.backstops_for_config(cfg) == []              # off by default
    on = cfg.replace(iptables_backstop=True)
    assert rules.backstops_for_config(on) == [
        BackstopRule("169.254.169.254", "cali+", "INPUT"),
        BackstopRule("169.254.169.254", "cali+", "FORWARD")]
    # "! -i eth0" would match the loopback, where the agent's own requests to a local
    # metadata address arrive: FORWARD only
    negated = on.replace(host_interface="!eth0", metadata_ipv6=True, host_ipv6="fd00::1")
    assert rules.backstops_for_config(negated) == [
        BackstopRule("169.254.169.254", "!eth0", "FORWARD"),
        BackstopRule("fd00:ec2::254", "!eth0", "FORWARD", 6)]


def test_the_dnat_rule_can_be_inserted_at_the_top():
    rule = Rule("169.254.169.254", "10.0.0.7", 8182, "cni0")
    argv = runner.command("-I", rule, position=1)
    assert argv[4:8] == ["nat", "-I", "PREROUTING", "1"]
    assert argv[8:] == rule.spec()
