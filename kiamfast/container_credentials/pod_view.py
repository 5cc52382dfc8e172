"""What a reviewed token's pod is answered, from the control process's node model: its
decision (the same ``PodDecision`` the metadata path answers from) and its credential slot.

The order of the checks after the review: the pod on this node, with the reviewed name and
service account (503 while the agent has not synced, or knows the pod only from its sandbox;
403 otherwise) → the role policy's decision (403 no role or denied; 503 undecided) → the
pod's credential slot, which must hold exactly the decided role and external ID (200, or
503 while it is being fetched).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import orjson

from kiamfast import table as tbl
from kiamfast.container_credentials.token_review import BoundPod, TokenRejected, unavailable
from kiamfast.credential_parts import account_id, parse_response
from kiamfast.decisions import IdentityKind, PodDecision


class Decisions(Protocol):
    """What is read of the control process's node model (`NodeModel`): the token path never
    imports the control process."""
    synced: bool

    def decision(self, uid: str) -> PodDecision | None: ...


class Slots(Protocol):
    """What is read of, and asked of, the credential manager."""

    def role_of_slot(self, slot: int) -> tuple[str, str | None] | None: ...

    def wanted(self, slot: int) -> None: ...


def forbidden(message: str) -> TokenRejected:
    return TokenRejected(403, "AccessDenied", message)


class PodView(Protocol):
    """What the answer needs of the control process: `resolve` a reviewed pod."""

    def known(self, uid: str) -> bool: ...

    def resolve(self, pod: BoundPod, now: float) -> "bytes | Wait": ...

    def want(self, slot: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Wait:
    """Not answerable yet: `why` is the answer if it stays so; `slot` to ask the manager for."""
    why: TokenRejected
    slot: int = -1


def container_document(imds_document: bytes, role_arn: str) -> bytes:
    """The container provider's JSON from the slot's IMDS document (same keys, same expiry)."""
    doc = orjson.loads(imds_document)
    if doc.get("Code") != "Success":     # STS refused the role for good
        raise forbidden(str(doc.get("Message") or "the role cannot be assumed"))
    return orjson.dumps({"AccessKeyId": doc["AccessKeyId"],
                         "SecretAccessKey": doc["SecretAccessKey"], "Token": doc["Token"],
                         "AccountId": account_id(role_arn) or "",
                         "Expiration": doc["Expiration"]})


class OwnershipView:
    """The node model's decisions (``NodeModel.decision``) and the credential slots."""

    def __init__(self, *, model: Decisions, manager: Slots, table: tbl.Table,
                 node: str) -> None:
        self.model = model
        self.manager = manager
        self.table = table
        self.node = node or "(all nodes)"

    def known(self, uid: str) -> bool:
        return self.model.decision(uid) is not None or not self.model.synced

    def want(self, slot: int) -> None:
        self.manager.wanted(slot)

    def resolve(self, pod: BoundPod, now: float) -> bytes | Wait:
        decision = self.model.decision(pod.uid)
        if decision is None or (decision.namespace, decision.name) != (pod.namespace,
                                                                       pod.name):
            if not self.model.synced:
                return Wait(unavailable("the agent has not synced this node's pods yet"))
            return Wait(forbidden(f"pod {pod.namespace}/{pod.name} is not on node "
                                  f"{self.node}"))
        if not decision.service_account:
            # Known from its sandbox only (the watch behind the runtime, or not synced after a
            # restart with the API server down): whose account it runs as is not known yet.
            return Wait(unavailable(f"the service account of pod {pod.namespace}/{pod.name} "
                                    "is not known yet (the agent has not had it from the "
                                    "API server)"))
        if decision.service_account != pod.service_account:
            raise forbidden(f"pod {pod.namespace}/{pod.name} does not run as service "
                            f"account {pod.service_account}")
        if decision.host_network and not decision.token_only:
            # The node's address is not its own: served only when every container asks by
            # token (the node model decides such a pod).
            raise forbidden(f"pod {pod.namespace}/{pod.name} runs on the host network and "
                            "not every container asks by token")
        if not decision.decided:
            raise forbidden(f"pod {pod.namespace}/{pod.name} is not running")
        ident = decision.identity
        if ident is None:
            return Wait(unavailable(f"the role of pod {pod.namespace}/{pod.name} is not "
                                    "decided yet"))
        if ident.kind == IdentityKind.NO_ROLE:
            raise forbidden(f"pod {pod.namespace}/{pod.name} has no role")
        if ident.kind == IdentityKind.DENIED:
            raise forbidden(ident.reason or f"pod {pod.namespace}/{pod.name} is denied")
        return self._credentials(decision, now)

    def _credentials(self, decision: PodDecision, now: float) -> bytes | Wait:
        slot = decision.cred_slot
        pending = Wait(unavailable(f"credentials for {decision.role_arn} are not fetched "
                                   "yet"), slot)
        # The slot must hold this very key (the metadata path's rule for an adopted slot).
        if slot < 0 or not decision.holds(self.manager.role_of_slot(slot)):
            return Wait(pending.why)
        try:
            state, serve_until, parts = self.table.read_cred(slot)
        except tbl.TableError:
            return pending
        if state != tbl.CRED_READY or serve_until <= now or len(parts) <= tbl.PART_DOCUMENT:
            return pending
        _, _, body = parse_response(parts[tbl.PART_DOCUMENT])
        return container_document(body, decision.role_arn)
