"""Keeps the DNAT rules of :mod:`kiamfast.iptables.rules` in place for the control
process's life: installs them, and puts back whatever another process deletes, at once
after an nftables change and at every ``--iptables-check-interval``.  Its own module so that
the supervisor, which needs the rules alone (the second port's), does not import asyncio."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from kiamfast.iptables.runner import (DEFAULT_TIMEOUT, IptablesError, check_interface,
                                       ensure_rule, insert_rule, plain_is_nft, remove_rules,
                                       resolve_backend)
from kiamfast.iptables.rules import AnyRule, backstops_for_config, rules_for_config

if TYPE_CHECKING:  # pragma: no cover
    from kiamfast.config import Config

log = logging.getLogger("kiamfast.iptables")

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NFNLGRP_NFTABLES = 7
SETTLE = 0.01          # a ruleset change comes as a burst of messages: check once after it
MIN_GAP = 0.1          # a storm of changes (kube-proxy syncing) costs at most 10 checks a second


class RuleKeeper:
    """Installs the DNAT rules (and the backstop) and puts back whatever disappears.

    :meth:`run` checks at ``--iptables-check-interval`` and, with the nft backend, at once
    after every change of the ruleset: the kernel sends each nftables transaction to the
    ``NFNLGRP_NFTABLES`` netlink group (it needs NET_ADMIN, which the agent has), so a rule
    deleted by someone else is back within a few milliseconds, and a node whose rules do
    not change costs one ``iptables -C`` per rule and interval.
    """

    def __init__(self, config: Config, *, netns: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.config = config
        self.netns = netns
        self.timeout = timeout
        self.rules: list[AnyRule] = [*rules_for_config(config)]
        self.backstops = backstops_for_config(config)
        self.backend: str | None = None
        self.restored = 0           # rules put back since start
        self.checks = 0

    def install(self) -> None:
        """Check the interface, pick the backend, ensure every rule (the backstop first, at
        the top of its chain, so no rule the CNI put before it accepts the traffic)."""
        check_interface(self.config.host_interface, netns=self.netns, timeout=self.timeout)
        self.backend = resolve_backend(self.config.iptables_backend, netns=self.netns,
                                       timeout=self.timeout)
        for backstop in self.backstops:
            insert_rule(backstop, backend=self.backend, netns=self.netns, timeout=self.timeout)
        for rule in self.rules:
            ensure_rule(rule, backend=self.backend, netns=self.netns, timeout=self.timeout)

    def check(self) -> int:
        """Put back every rule that is missing; how many were."""
        self.checks += 1
        missing = 0
        for backstop in self.backstops:
            if insert_rule(backstop, backend=self.backend, netns=self.netns,
                           timeout=self.timeout):
                missing += 1
                log.warning("the backstop rule was removed by another process; put back: %s",
                            backstop)
        for rule in self.rules:
            if ensure_rule(rule, backend=self.backend, netns=self.netns, timeout=self.timeout):
                missing += 1
                log.warning("the DNAT rule was removed by another process (kube2iam's "
                            "preStop hook deletes every rule naming the metadata address); "
                            "put back: %s", rule)
        self.restored += missing
        return missing

    async def run(self) -> None:
        """Forever: :meth:`check` after each ruleset change (nft) and every interval."""
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        events = self._nft_events() if self.netns is None and self._nft() else None
        if events is not None:
            loop.add_reader(events.fileno(), self._drain, events, changed)
        last = 0.0
        try:
            while True:
                try:
                    await asyncio.wait_for(changed.wait(), self.config.iptables_check_interval)
                    await asyncio.sleep(max(SETTLE, last + MIN_GAP - loop.time()))
                except asyncio.TimeoutError:
                    pass
                changed.clear()
                last = loop.time()
                try:
                    await loop.run_in_executor(None, self.check)
                except IptablesError as e:   # a stuck xtables lock: next time
                    log.error("cannot check the iptables rules: %s", e)
        finally:
            if events is not None:
                loop.remove_reader(events.fileno())
                events.close()

    def _nft(self) -> bool:
        if self.backend is not None:
            return self.backend == "nft"
        return plain_is_nft(timeout=self.timeout)

    def _nft_events(self) -> socket.socket | None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        except OSError:
            return None
        try:
            sock.bind((0, 0))
            sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTABLES)
            sock.setblocking(False)
        except OSError as e:
            log.info("no nftables change notifications (%s): checking every %gs only", e,
                     self.config.iptables_check_interval)
            sock.close()
            return None
        return sock

    @staticmethod
    def _drain(sock: socket.socket, changed: asyncio.Event) -> None:
        while True:
            try:
                sock.recv(65536)
            except BlockingIOError:
                break
            except OSError:      # ENOBUFS: messages were lost, so something changed
                break
        changed.set()

    def remove(self) -> int:
        return remove_rules(self.config, netns=self.netns, timeout=self.timeout)
