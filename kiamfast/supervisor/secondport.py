"""``--handover-port``: taking a node over from a process that cannot hand over.

kube2iam, or a kiamfast without ``--handover-socket``, holds ``--app-port`` and can neither
pass its listening socket nor share it (and kiamfast never binds with SO_REUSEPORT).  So the
new agent serves on a second port, and the DNAT rule decides who gets pods' connections:

1. it binds ``--handover-port`` and starts as usual (its own table: the old agent's lock
   still holds the shared one, so it writes ``<table>-2``; kube2iam has no table);
2. once its own control process is ready, it inserts its DNAT rule to the second port at
   the top of the nat PREROUTING chain (one ``iptables -I``, atomic): new connections
   come to it, established ones finish on the old process;
3. when the old process lets go of ``--app-port`` (its pod was deleted), it binds it,
   swaps its workers for ones that accept on both ports, makes sure the app-port rule is
   there (the control process keeps it) and deletes the second-port rule: new
   connections go to the app port again, now its own;
4. after DRAIN seconds it swaps its workers for ones on the app port only and closes the
   second port.  The steady state is the one the chart's probes and Service expect.

At no moment is there no rule (the old rule or ours always matches: never fail open), and
no socket a rule points to is closed while connections can still arrive through it.  A
connection is refused only where the old process refuses it itself (kube2iam closing its
port while a rule still sends pods to it: after step 2 none does).  Stopped before step 3,
the agent deletes its second-port rule, so pods go back to the old process.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from kiamfast.iptables import runner
from kiamfast.iptables import rules
from kiamfast.sockets import ListenError, listen_socket
from kiamfast.supervisor.listeners import APP, SECOND, Listener, Listeners


class Owner(Protocol):
    """The supervisor, as the second port uses it."""
    config: Any
    listeners: Listeners

    def own_control_ready(self) -> bool: ...
    def swap_workers(self) -> None: ...
    def deposit(self) -> None: ...


log = logging.getLogger("kiamfast.supervisor")

BIND_EVERY = 0.2     # how often the app port is tried while the old process holds it
DRAIN = 5.0          # the second port stays open this long after its rule is gone


def second_port_rules(config) -> list[rules.Rule]:
    """The DNAT rules to --handover-port (the app-port rules with the other port)."""
    if not config.iptables:
        return []
    return [rules.Rule(r.metadata_addr, r.host_ip, config.handover_port,
                                r.host_interface, r.family)
            for r in rules.rules_for_config(config)]


def remove_stale_rules(config) -> None:
    """A second-port rule a stopped agent left points at a port nobody listens on: gone."""
    stale = second_port_rules(config)
    if not stale:
        return
    try:
        backend = runner.resolve_backend(config.iptables_backend)
        for rule in stale:
            runner.remove_rule(rule, backend=backend)
    except runner.IptablesError as e:
        log.error("cannot remove a stale second-port rule: %s", e)


class SecondPort:
    def __init__(self, sup: Owner) -> None:
        self.sup = sup
        self.config = sup.config
        self.rules = second_port_rules(self.config)
        self.backend: str | None = None
        self.state = "starting"
        self.next_try = 0.0
        self.drain_until = 0.0
        log.warning("--app-port %d is held by a process that cannot hand over: serving on "
                    "--handover-port %d until it lets go", self.config.app_port,
                    self.config.handover_port)

    def busy(self) -> str:
        return "" if self.state == "done" else (
            f"moving to --app-port from --handover-port {self.config.handover_port} "
            f"({self.state})")

    def tick(self, now: float) -> None:
        if self.state == "starting":
            if self.sup.own_control_ready():
                self._divert()
        elif self.state == "diverted":
            if now >= self.next_try:
                self.next_try = now + BIND_EVERY
                self._try_app_port()
        elif self.state == "draining" and now >= self.drain_until:
            self._close_second_port()

    def _divert(self) -> None:
        """Step 2: new connections to the second port, ahead of the old process's rule."""
        if self.rules:
            self.backend = runner.resolve_backend(self.config.iptables_backend)
            for rule in self.rules:
                runner.insert_rule(rule, backend=self.backend, position=1)
        log.info("ready on --handover-port %d: pods' new connections come here",
                 self.config.handover_port)
        self.state = "diverted"

    def _try_app_port(self) -> None:
        """Step 3, once the old process has let go of the app port."""
        try:
            sock = listen_socket(self.config.listen_host or None, self.config.app_port)
        except ListenError:
            return
        log.info("--app-port %d is free: moving back to it", self.config.app_port)
        self.sup.listeners.add(Listener(APP, self.config.listen_host, self.config.app_port,
                                        sock))
        self.sup.swap_workers()
        if self.rules:
            for rule in rules.rules_for_config(self.config):
                runner.ensure_rule(rule, backend=self.backend)
            self.remove_rules()
        self.drain_until = time.monotonic() + DRAIN
        self.state = "draining"

    def _close_second_port(self) -> None:
        """Step 4: the steady state, the app port only."""
        second = self.sup.listeners.of_kind(SECOND)
        self.sup.listeners.drop(second)
        self.sup.swap_workers()
        for lst in second:
            lst.close()
        self.sup.deposit()
        self.state = "done"
        log.info("serving on --app-port %d only; --handover-port %d closed",
                 self.config.app_port, self.config.handover_port)

    def remove_rules(self) -> None:
        for rule in self.rules:
            try:
                runner.remove_rule(rule, backend=self.backend)
            except runner.IptablesError as e:
                log.error("cannot remove the second-port rule %s: %s", rule, e)

    def stop(self) -> None:
        """Stopping before the move back: pods go back to the old process's rule."""
        if self.state in ("diverted", "starting"):
            self.remove_rules()
