"""Running iptables: checking, adding and deleting the rules of
:mod:`kiamfast.iptables.rules` on the node.

Installation is check-then-append (``-C``, then ``-A``), so calling :func:`ensure_rule` any
number of times leaves one copy.  The rules are left in place on exit unless
``--iptables-remove-on-exit``: without an agent a pod must get a refused connection, never
the node's own role from the real metadata service.  Keeping them in place while the agent
runs is :mod:`kiamfast.iptables.keeper`'s job.

This module only runs the iptables binaries (with a timeout, under the xtables lock with
``-w``), picking the backend (nft or legacy) the node's kube-proxy uses, because a rule in
the other backend's tables may be evaluated in an order nobody expects. The argv builder
(:func:`command`) is a pure function so it can be tested without root. It must never flush
or rewrite chains: the nat table belongs to kube-proxy and the CNI, we only add and delete
our rules.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kiamfast.iptables.rules import (AnyRule, IptablesError, Rule,
                                             backstops_for_config, rules_for_config)

if TYPE_CHECKING:  # pragma: no cover
    from kiamfast.config import Config

__all__ = [
    "InterfaceNotFound",
    "IptablesError",
    "IptablesNotFound",
    "IptablesNotPermitted",
    "IptablesTimeout",
    "check_interface",
    "command",
    "detect_backend",
    "ensure_rule",
    "insert_rule",
    "install_rules",
    "plain_is_nft",
    "remove_rule",
    "remove_rules",
    "resolve_backend",
    "rule_present",
]

log = logging.getLogger("kiamfast.iptables")

DEFAULT_TIMEOUT = 10.0
LOCK_WAIT_SECONDS = 5


class IptablesNotFound(IptablesError):
    """The iptables (or ip6tables / ip) binary is not installed."""


class IptablesNotPermitted(IptablesError):
    """The kernel refused: the process lacks CAP_NET_ADMIN (in the host's namespace)."""


class IptablesTimeout(IptablesError):
    """An iptables command did not finish in time (a stuck xtables lock, usually)."""


class InterfaceNotFound(IptablesError):
    """--host-interface names an interface that does not exist (and is no wildcard)."""


def _binary(family: int, backend: str | None) -> str:
    base = "ip6tables" if family == 6 else "iptables"
    return f"{base}-{backend}" if backend in ("nft", "legacy") else base


def _prefix(netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns] if netns else []


def command(action: str, rule: AnyRule, *, backend: str | None = None,
            netns: str | None = None, position: int = 1) -> list[str]:
    """argv of one iptables call: ``action`` is ``-C``, ``-A``, ``-D`` or ``-I`` (at
    ``position``).

    ``backend`` is ``nft``, ``legacy`` or None (the distribution's ``iptables``); ``netns``
    runs the command in that network namespace (``ip netns exec``), for tests.
    """
    if action not in ("-C", "-A", "-D", "-I"):
        raise ValueError(f"unsupported action {action!r}")
    where = [rule.chain, str(position)] if action == "-I" else [rule.chain]
    return [*_prefix(netns), _binary(rule.family, backend), "-w", str(LOCK_WAIT_SECONDS),
            "-t", rule.table, action, *where, *rule.spec()]


def _run(argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except FileNotFoundError:
        raise IptablesNotFound(f"{argv[0]} not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise IptablesTimeout(f"{' '.join(argv)} did not finish within {timeout:g}s") from None
    if list(argv[:3]) == ["ip", "netns", "exec"] and proc.stderr.startswith('exec of "'):
        # ip netns exec exits 1 (like "rule absent") when the binary is missing.
        raise IptablesNotFound(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _fail(argv: Sequence[str], proc: subprocess.CompletedProcess[str]) -> IptablesError:
    detail = (proc.stderr or proc.stdout).strip().replace("\n", "; ")
    if proc.returncode == 127:
        return IptablesNotFound(f"{' '.join(argv)}: {detail}")
    if "Permission denied" in detail or "Operation not permitted" in detail:
        return IptablesNotPermitted(f"{' '.join(argv)} failed (exit {proc.returncode}): "
                                    f"{detail}")
    return IptablesError(f"{' '.join(argv)} failed (exit {proc.returncode}): {detail}")


def rule_present(rule: AnyRule, *, backend: str | None = None, netns: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Whether the rule is in its chain (``iptables -C``)."""
    argv = command("-C", rule, backend=backend, netns=netns)
    proc = _run(argv, timeout=timeout)
    if proc.returncode == 0:
        return True
    if proc.returncode == 1:
        # "Bad rule (does a matching rule exist...)" or, before the nat table exists in a
        # fresh nft namespace, "No chain/target/match by that name".
        return False
    raise _fail(argv, proc)


def ensure_rule(rule: Rule, *, backend: str | None = None, netns: str | None = None,
                timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Install the rule unless it is already there. Returns True if it was appended."""
    if rule_present(rule, backend=backend, netns=netns, timeout=timeout):
        log.debug("iptables rule already present: %s", rule)
        return False
    argv = command("-A", rule, backend=backend, netns=netns)
    proc = _run(argv, timeout=timeout)
    if proc.returncode != 0:
        raise _fail(argv, proc)
    log.info("installed iptables rule: %s", rule)
    return True


def insert_rule(rule: AnyRule, *, backend: str | None = None, netns: str | None = None,
                timeout: float = DEFAULT_TIMEOUT, position: int = 1) -> bool:
    """Insert the rule at ``position`` of its chain unless it is there already (anywhere).
    Returns True if it was inserted."""
    if rule_present(rule, backend=backend, netns=netns, timeout=timeout):
        return False
    argv = command("-I", rule, backend=backend, netns=netns, position=position)
    proc = _run(argv, timeout=timeout)
    if proc.returncode != 0:
        raise _fail(argv, proc)
    log.info("installed iptables rule: %s", rule)
    return True


def remove_rule(rule: AnyRule, *, backend: str | None = None, netns: str | None = None,
                timeout: float = DEFAULT_TIMEOUT) -> int:
    """Delete every copy of the rule. Returns how many were deleted (0 if absent)."""
    removed = 0
    while removed < 1000 and rule_present(rule, backend=backend, netns=netns,
                                          timeout=timeout):
        argv = command("-D", rule, backend=backend, netns=netns)
        proc = _run(argv, timeout=timeout)
        if proc.returncode != 0:
            raise _fail(argv, proc)
        removed += 1
    if removed:
        log.info("removed iptables rule (%d cop%s): %s", removed,
                 "y" if removed == 1 else "ies", rule)
    return removed


def check_interface(host_interface: str, *, netns: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT) -> None:
    """Raise :class:`InterfaceNotFound` unless the interface exists.

    Wildcards (``eni+``) and negations (``!eth0``) are not checked, as in kube2iam (which
    only skips ``+``) and kiam.
    """
    if not host_interface or host_interface == "!":
        raise InterfaceNotFound(f'invalid --host-interface "{host_interface}"')
    if "+" in host_interface or host_interface.startswith("!"):
        return
    if netns is None:
        try:
            socket.if_nametoindex(host_interface)
            return
        except OSError:
            pass
    else:
        argv = ["ip", "-netns", netns, "-o", "link", "show", "dev", host_interface]
        proc = _run(argv, timeout=timeout)
        if proc.returncode == 0:
            return
    raise InterfaceNotFound(
        f'--host-interface "{host_interface}" does not exist on this node; use the '
        f"interface pods' traffic arrives on (docker0, cni0, cali+, eni+, lxc+, ...)")


def detect_backend(*, netns: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> str | None:
    """The iptables backend kube-proxy uses on this node: ``nft``, ``legacy`` or None.

    Same decision as kubernetes-sigs/iptables-wrappers: kube-proxy and the kubelet leave a
    ``KUBE-IPTABLES-HINT`` / ``KUBE-KUBELET-CANARY`` chain in the mangle table of the
    backend they use; without one, the backend holding more rules wins (nft on a tie).
    None when the image has only one ``iptables`` (no choice to make).
    """
    if not (shutil.which("iptables-nft") and shutil.which("iptables-legacy")):
        return None
    for backend in ("nft", "legacy"):
        for chain in ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"):
            argv = [*_prefix(netns), f"iptables-{backend}", "-w", str(LOCK_WAIT_SECONDS),
                    "-t", "mangle", "-S", chain]
            if _run(argv, timeout=timeout).returncode == 0:
                return backend
    counts = {}
    for backend in ("nft", "legacy"):
        lines = 0
        for base in ("iptables", "ip6tables"):
            proc = _run([*_prefix(netns), f"{base}-{backend}-save"], timeout=timeout)
            lines += sum(1 for line in proc.stdout.splitlines() if line.startswith("-"))
        counts[backend] = lines
    return "legacy" if counts["legacy"] > counts["nft"] else "nft"


def plain_is_nft(*, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Whether the image's plain ``iptables`` is the nf_tables one (False if it cannot run)."""
    try:
        return "nf_tables" in _run(["iptables", "-V"], timeout=timeout).stdout
    except IptablesError:
        return False


def resolve_backend(setting: str, *, netns: str | None = None,
                    timeout: float = DEFAULT_TIMEOUT) -> str | None:
    """``--iptables-backend``: auto -> :func:`detect_backend`; nft / legacy as given."""
    if setting in ("nft", "legacy"):
        return setting
    backend = detect_backend(netns=netns, timeout=timeout)
    log.info("iptables backend: %s", backend or "default")
    return backend


def install_rules(config: Config, *, netns: str | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> list[Rule]:
    """Check the interface, pick the backend and ensure every rule of ``config``."""
    rules = rules_for_config(config)
    check_interface(config.host_interface, netns=netns, timeout=timeout)
    backend = resolve_backend(config.iptables_backend, netns=netns, timeout=timeout)
    for rule in rules:
        ensure_rule(rule, backend=backend, netns=netns, timeout=timeout)
    return rules


def remove_rules(config: Config, *, netns: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> int:
    """Remove every rule of ``config``, the backstop's included
    (``--iptables-remove-on-exit``)."""
    backend = resolve_backend(config.iptables_backend, netns=netns, timeout=timeout)
    removed = 0
    for rule in [*rules_for_config(config), *backstops_for_config(config)]:
        removed += remove_rule(rule, backend=backend, netns=netns, timeout=timeout)
    return removed
