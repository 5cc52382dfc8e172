"""A pod's decision, as every part of the agent reads it: what the role policy decided for a
pod (:class:`PodIdentity`) and the public, immutable :class:`PodDecision` the control process's
table entries and the container-credentials path both answer from.  Below both: it imports
nothing of the agent's (the control process's node model makes decisions,
``control/mappings/decider.py``; the token path only reads them)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class IdentityKind(enum.IntEnum):
    ROLE = 1
    NO_ROLE = 2
    DENIED = 3


@dataclass(frozen=True, slots=True)
class PodIdentity:
    """What the role policy decided for one pod.  Compare with `==`: equal decisions need no
    table write."""

    kind: IdentityKind
    role_arn: str = ""
    external_id: str = ""
    reason: str = ""
    # DENIED only because the pod's namespace is not (yet) known to the agent.
    namespace_unknown: bool = False

    @classmethod
    def role(cls, arn: str, external_id: str = "") -> "PodIdentity":
        return cls(IdentityKind.ROLE, arn, external_id)

    @classmethod
    def denied(cls, reason: str) -> "PodIdentity":
        return cls(IdentityKind.DENIED, reason=reason)


NO_ROLE = PodIdentity(IdentityKind.NO_ROLE)

@dataclass(frozen=True, slots=True)
class PodDecision:
    """One pod's decision, as both answer paths read it.

    ``identity`` None: undecided (its requests wait).  ``cred_slot``: the credential slot
    that holds its role's credentials (-1: none).  ``address``: the pod's first address,
    for kube2iam's session names (None before it has one).  ``source``: what the decision
    rests on: ``api`` (the API's pod), ``sandbox`` (the runtime's copy of its annotations,
    the watch behind) or ``adopted`` (a previous control process's, the API unreachable)."""
    uid: str
    namespace: str
    name: str
    service_account: str
    identity: PodIdentity | None
    cred_slot: int = -1
    token_only: bool = False
    host_network: bool = False
    decided: bool = True                  # False: terminal, or hostNetwork not by token
    address: str | None = None
    source: str = "api"

    @property
    def role_arn(self) -> str:
        return self.identity.role_arn if self.identity is not None else ""

    @property
    def pod_name(self) -> str:              # what the credential manager's keys read
        return self.name

    @property
    def pod_ip(self) -> str | None:
        return self.address

    @property
    def external_id(self) -> str:
        return self.identity.external_id if self.identity is not None else ""

    def holds(self, role_of_slot: tuple[str, str | None] | None) -> bool:
        """Whether a slot holding (role, external ID) holds exactly this decision's role."""
        return (self.identity is not None and self.identity.kind == IdentityKind.ROLE
                and role_of_slot == (self.role_arn, self.external_id or None))
