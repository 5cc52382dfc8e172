"""A pod's decision: which role its requests get, or why none, and on what evidence.

The role policy (:mod:`kiamfast.control.mappings.policy`: annotations, namespace restrictions,
the default role) decides from the API's pod, or, for a pod the runtime shows before the
watch delivers it, from its sandbox's annotations (the kubelet copies the pod's there).  Two
rules on top:

* **A namespace not seen yet** (the namespace watch behind the pod watch): the pod is
  *undecided* (its requests wait) for at most ``namespace_grace`` seconds, then denied.
* **A restart**: what a previous control process decided stands for a pod whose namespace
  the agent has not seen yet, until the API can overrule it (the namespace arrives, or the
  watch has synced) — only a role, and only if the credential slot it wrote holds this very
  role and external ID.  Adopted evidence may keep a pod served, never turn it away: a
  denial it wrote is not current evidence.

The result is a :class:`kiamfast.decisions.PodDecision`, immutable, public: the table's
address entries and the container-credentials path read the same object.  What the model
knows of a pod meanwhile is its :class:`PodRecord`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiamfast.decisions import IdentityKind, PodIdentity

if TYPE_CHECKING:
    from kiamfast.control.mappings.policy import NamespaceRules, RolePolicy

log = logging.getLogger("kiamfast.ownership")

LIVE_PHASES = frozenset({"", "Pending", "Running", "Unknown"})

# Claim key: (resourceVersion that first showed it, creationTimestamp, not terminating, uid)
ClaimKey = tuple[int, str, int, str]


@dataclass(slots=True)
class PodRecord:
    """What the model knows of one pod (mutable; the model's own)."""
    uid: str
    namespace: str
    name: str
    from_api: bool = True                 # False: known only from a runtime sandbox
    rv: int = 0
    created: str = ""
    phase: str = ""
    host_network: bool = False
    terminating: bool = False
    annotations: Mapping[str, str] = field(default_factory=dict)
    service_account: str = ""
    token_only: bool = False              # asks by token: the metadata path refuses it
    api_ips: tuple[str, ...] = ()
    identity: PodIdentity | None = None   # None: undecided (not yet evaluated / ns unknown)
    undecided_since: float | None = None
    cred_slot: int = -1
    cred_key: tuple[str, str, str | None] | None = None   # (role, external id, address) acquired
    source: str = "api"                   # what its identity rests on (PodDecision.source)
    claims: dict[str, ClaimKey] = field(default_factory=dict)   # API ownership only

    @property
    def live(self) -> bool:
        return self.phase in LIVE_PHASES and not self.host_network

    @property
    def decided(self) -> bool:
        """Does it get a role decision and credentials?  Live pods, and a hostNetwork pod
        that asks by token only: it owns no address (the node's is not its own), so the
        metadata path never serves it, but its token names it."""
        return self.live or (self.host_network and self.token_only
                             and self.phase in LIVE_PHASES)


class Decider:
    """The role policy (`policy.RolePolicy`) with the two rules of the module docstring."""

    def __init__(self, *, policy: RolePolicy, namespace_grace: float,
                 clock: Callable[[], float],
                 role_of_slot: Callable[[int], tuple[str, str | None] | None],
                 adopted: Mapping[str, int]) -> None:
        self.policy = policy
        self.namespace_grace = namespace_grace
        self.clock = clock
        self.role_of_slot = role_of_slot
        # uid -> credential slot of a role a previous control process decided (see above)
        self.adopted: dict[str, int] = dict(adopted)
        self.synced = False

    def decide(self, pod: PodRecord,
               rules: NamespaceRules | None) -> tuple[PodIdentity | None, str]:
        """(identity or None = wait, source) for a live pod; keeps ``undecided_since``."""
        ident = self.policy.decide(pod.annotations, rules, namespace=pod.namespace,
                                   pod=pod.name)
        source = "api" if pod.from_api else "sandbox"
        if rules is None and ident.kind == IdentityKind.DENIED and ident.namespace_unknown:
            adopted = self._adopted_identity(pod, ident)
            if adopted is not None:
                pod.undecided_since = None
                return adopted, "adopted"
            now = self.clock()
            if pod.undecided_since is None:
                pod.undecided_since = now
            if now - pod.undecided_since <= self.namespace_grace:
                return None, source   # our namespace watch is behind the pod watch: wait
            log.warning("pod %s/%s: namespace %s still unknown after %.0fs; denying",
                        pod.namespace, pod.name, pod.namespace, self.namespace_grace)
        pod.undecided_since = None
        return ident, source

    def waited_too_long(self, pod: PodRecord, now: float) -> bool:
        return (pod.undecided_since is not None
                and now - pod.undecided_since > self.namespace_grace)

    def _adopted_identity(self, pod: PodRecord, ident: PodIdentity) -> PodIdentity | None:
        slot = self.adopted.get(pod.uid) if not self.synced else None
        if slot is None:
            return None
        external_id = (pod.annotations.get(self.policy.external_id_key) or "").strip()
        if self.role_of_slot(slot) != (ident.role_arn, external_id or None):
            return None
        return PodIdentity.role(ident.role_arn, external_id)
