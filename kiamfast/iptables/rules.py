"""The rules that send pods' metadata traffic to the agent, as data: which ones a
configuration asks for, and the exact words iptables is given and prints for them.

kube2iam installs exactly one rule, and a node migrating from kube2iam must end up with the
same one (so the agent recognises a rule kube2iam left behind instead of adding a second)::

    iptables -t nat -A PREROUTING -p tcp -d 169.254.169.254 --dport 80 \\
        -j DNAT --to-destination <host-ip>:<app-port> -i <host-interface>

The interface may be a ``+`` wildcard (``eni+``) or kiam's negation ``!eth0`` (rendered
``! -i eth0``). With ``--metadata-ipv6`` the same rule is built for ip6tables and the IPv6
metadata address ``fd00:ec2::254``.

Installed once, the rule can still be taken away: kube2iam's newest chart runs, in its pod's
preStop hook, ``eval `iptables-save | grep 169.254.169.254 | sed s/-A/'iptables -t nat -D'/g```,
which deletes kiamfast's rule as well when it is the only line naming the address (the
control process's :class:`~kiamfast.iptables.keeper.RuleKeeper` puts it back).  So
``--iptables-backstop`` adds, in the filter table that no nat cleanup touches, a rule
(:class:`BackstopRule`) that resets pods' connections to the metadata address that were
*not* redirected (after the DNAT their destination is the agent, so the backstop never sees
them), in FORWARD (the metadata address is routed off the node) and INPUT (a node where it
is local).  The agent's own requests to the metadata service leave through OUTPUT, which
neither rule touches.

Pure functions of the configuration: no iptables is run here (:mod:`kiamfast.iptables.runner`
runs it), so all of it is tested without root.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Union

if TYPE_CHECKING:  # pragma: no cover
    from kiamfast.config import Config

log = logging.getLogger("kiamfast.iptables")

METADATA_IPV6 = "fd00:ec2::254"
CHAIN = "PREROUTING"
TABLE = "nat"


class IptablesError(Exception):
    """Installing, checking or removing the rule failed (or no rule can be built)."""


@dataclass(frozen=True)
class Rule:
    """One DNAT rule. ``family`` is 4 (iptables) or 6 (ip6tables)."""

    metadata_addr: str
    host_ip: str
    app_port: int
    host_interface: str
    family: int = 4
    table: ClassVar[str] = TABLE
    chain: ClassVar[str] = CHAIN

    def spec(self) -> list[str]:
        return rule_spec(metadata_addr=self.metadata_addr, host_ip=self.host_ip,
                         app_port=self.app_port, host_interface=self.host_interface)

    def __str__(self) -> str:
        return " ".join(["ip6tables" if self.family == 6 else "iptables", "-t", TABLE,
                         "-A", CHAIN, *self.spec()])


BACKSTOP_COMMENT = "kiamfast: metadata traffic not redirected to the agent"


@dataclass(frozen=True)
class BackstopRule:
    """The filter-table backstop in ``chain`` (INPUT or FORWARD): pods' TCP connections to
    the metadata address on port 80 that no DNAT redirected are reset."""

    metadata_addr: str
    host_interface: str
    chain: str
    family: int = 4
    table: ClassVar[str] = "filter"

    def spec(self) -> list[str]:
        return ["-p", "tcp", "-d", self.metadata_addr, "--dport", "80",
                *_interface_args(self.host_interface), "-m", "comment", "--comment",
                BACKSTOP_COMMENT, "-j", "REJECT", "--reject-with", "tcp-reset"]

    def __str__(self) -> str:
        return " ".join(["ip6tables" if self.family == 6 else "iptables", "-t", self.table,
                         "-I", self.chain, *self.spec()])


AnyRule = Union[Rule, BackstopRule]


def _destination(host_ip: str, port: int) -> str:
    ip = ipaddress.ip_address(host_ip)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _interface_args(host_interface: str) -> list[str]:
    if host_interface.startswith("!"):
        return ["!", "-i", host_interface[1:]]
    return ["-i", host_interface]


def rule_spec(*, metadata_addr: str, host_ip: str, app_port: int,
              host_interface: str) -> list[str]:
    """The rule body in kube2iam's order (after ``-t nat -A PREROUTING``)."""
    return ["-p", "tcp", "-d", metadata_addr, "--dport", "80", "-j", "DNAT",
            "--to-destination", _destination(host_ip, app_port),
            *_interface_args(host_interface)]


def saved_form(rule: Rule) -> str:
    """The rule as ``iptables -t nat -S PREROUTING`` prints it once installed."""
    prefix = 128 if rule.family == 6 else 32
    iface = " ".join(_interface_args(rule.host_interface))
    return (f"-A {CHAIN} -d {ipaddress.ip_address(rule.metadata_addr)}/{prefix} {iface} "
            f"-p tcp -m tcp --dport 80 -j DNAT --to-destination "
            f"{_destination(rule.host_ip, rule.app_port)}")


def rules_for_config(config: Config) -> list[Rule]:
    """The rules ``config`` asks for: the IPv4 rule, plus the IPv6 one with --metadata-ipv6.

    Raises :class:`IptablesError` when no rule can be built (no --host-ip of the right
    family); an IPv6 rule that cannot be built is skipped with a warning.
    """
    rules: list[Rule] = []
    if not config.host_ip:
        raise IptablesError("--iptables needs --host-ip (or $HOST_IP)")
    metadata_host = config.metadata_host
    if ipaddress.ip_address(config.host_ip).version == 4:
        rules.append(Rule(metadata_host, config.host_ip, config.app_port,
                          config.host_interface, 4))
    else:
        log.warning("--host-ip %s is IPv6: no IPv4 DNAT rule for %s", config.host_ip,
                    metadata_host)
    if config.metadata_ipv6:
        if config.host_ipv6:
            rules.append(Rule(METADATA_IPV6, config.host_ipv6, config.app_port,
                              config.host_interface, 6))
        else:
            log.warning("--metadata-ipv6 is set but the node has no IPv6 address "
                        "(--host-ipv6, $HOST_IPS): the IPv6 rule for %s is skipped",
                        METADATA_IPV6)
    if not rules:
        raise IptablesError("no DNAT rule can be installed: --host-ip is IPv6 and "
                            "--metadata-ipv6 is not set")
    return rules


def backstops_for_config(config: Config) -> list[BackstopRule]:
    """The backstop rules of ``config`` (``--iptables-backstop``): FORWARD for every pod
    interface, INPUT too unless the interface is negated (``! -i eth0`` would match the
    loopback, where the agent's own requests to a local metadata address arrive)."""
    if not config.iptables_backstop:
        return []
    chains = ["FORWARD"] if config.host_interface.startswith("!") else ["INPUT", "FORWARD"]
    out = [BackstopRule(config.metadata_host, config.host_interface, chain, 4)
           for chain in chains]
    if config.metadata_ipv6:
        out += [BackstopRule(METADATA_IPV6, config.host_interface, chain, 6)
                for chain in chains]
    return out
