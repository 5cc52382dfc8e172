"""What ``kiamfast demo`` sets up: one node, two namespaces with role restrictions, the pods.

Why it exists: the demo's story is data, kept apart from the machinery that plays it so the
two can be read (and changed) separately. Every pod states the identity it must end up with
and why, in the words the demo prints; the judge (:mod:`kiamfast.demo.check`) holds the
agent to exactly that.

The expectations are written out by hand, not computed with kiamfast's own role rules
(:mod:`kiamfast.control.mappings.policy`): a demo that asked the code under test what the right answer
is could never catch it being wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

__all__ = [
    "ACCOUNT", "BASE_ROLE_ARN", "DEFAULT_ROLE", "NAMESPACES", "NODE", "PODS", "DemoPod",
    "ExpectationError", "apply_expectations", "parse_expectation", "role_arn",
]

ACCOUNT = "123456789012"
BASE_ROLE_ARN = f"arn:aws:iam::{ACCOUNT}:role/"
DEFAULT_ROLE = "demo-default"
NODE = "demo-node"
ROLE_KEY = "iam.amazonaws.com/role"
NAMESPACE_KEY = "iam.amazonaws.com/allowed-roles"
STARTUP_TAINT = "kiamfast.io/agent-not-ready"

#: namespace -> roles its pods may use (kube2iam's allowed-roles annotation, glob entries).
NAMESPACES: dict[str, list[str]] = {
    "shop": ["shop-*"],
    "billing": ["billing-*"],
}


def role_arn(name: str) -> str:
    """A role as kube2iam normalises an annotation: full ARNs verbatim, names under the base."""
    return name if name.lower().startswith("arn:") else BASE_ROLE_ARN + name


@dataclass(frozen=True)
class DemoPod:
    """A pod of the demo: where it lives, what it asks for, what it must get.

    ``role`` is the annotation (None: no annotation); ``expect`` the IAM role ARN the pod
    must receive (None: it must be refused); ``note`` says why, for the output.
    """

    namespace: str
    name: str
    ip: str
    role: str | None
    expect: str | None
    note: str = ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def annotations(self) -> dict[str, str]:
        return {ROLE_KEY: self.role} if self.role is not None else {}


def _pod(namespace: str, name: str, ip: str, role: str | None, *,
         expect: str | None | type = ..., note: str = "") -> DemoPod:
    if expect is ...:
        expect = role
    return DemoPod(namespace, name, ip, role, role_arn(expect) if expect else None, note)


#: The pods of the main table, all Running on the node before the agent starts.
PODS: tuple[DemoPod, ...] = (
    _pod("shop", "checkout", "127.0.10.11", "shop-checkout"),
    _pod("shop", "catalog", "127.0.10.12", "shop-catalog"),
    _pod("shop", "intruder", "127.0.10.13", "billing-admin", expect=None,
         note="billing-admin is not among shop's allowed roles (shop-*): refused"),
    _pod("billing", "invoices", "127.0.10.21", "billing-invoices"),
    _pod("billing", "reports", "127.0.10.22", "billing-reports"),
    _pod("billing", "cron", "127.0.10.23", None, expect=DEFAULT_ROLE,
         note=f"no annotation: the default role ({DEFAULT_ROLE})"),
)

#: Race 1: created while the demo runs; only the container runtime knows its address when
#: it asks.
LATE_IP_POD = _pod("shop", "fresh", "127.0.10.30", "shop-fresh")

#: Race 2: the old owner of an address (Running before the agent starts) and its successor,
#: whose sandbox gets the address while the API still shows the old pod Running.
REUSE_OLD_POD = _pod("shop", "cart-v1", "127.0.10.40", "shop-cart-v1")
REUSE_NEW_POD = _pod("shop", "cart-v2", "127.0.10.40", "shop-cart-v2")

ALL_PODS: tuple[DemoPod, ...] = PODS + (LATE_IP_POD, REUSE_OLD_POD, REUSE_NEW_POD)


def namespace_annotations(namespace: str) -> dict[str, str]:
    return {NAMESPACE_KEY: json.dumps(NAMESPACES[namespace])}


class ExpectationError(ValueError):
    """A ``--expect`` value the demo cannot use (unknown pod, bad syntax)."""


def parse_expectation(text: str) -> tuple[str, str | None]:
    """``NAMESPACE/POD=ROLE`` -> (pod ref, expected role ARN or None).

    ROLE is a role name (under the base ARN), a full role ARN, or ``none`` / ``denied`` /
    ``refused`` for "must get no credentials".
    """
    ref, eq, role = text.partition("=")
    ref, role = ref.strip(), role.strip()
    if not eq or not ref or not role:
        raise ExpectationError(f"--expect wants NAMESPACE/POD=ROLE, got {text!r}")
    if ref not in {p.ref for p in ALL_PODS}:
        known = ", ".join(p.ref for p in ALL_PODS)
        raise ExpectationError(f"--expect: no demo pod {ref!r} (pods: {known})")
    if role.lower() in ("none", "denied", "refused"):
        return ref, None
    return ref, role_arn(role)


def apply_expectations(pods: tuple[DemoPod, ...], overrides: dict[str, str | None]
                       ) -> tuple[DemoPod, ...]:
    """The pods with some expectations replaced (``--expect``: to watch the demo fail)."""
    out = []
    for pod in pods:
        if pod.ref in overrides:
            pod = replace(pod, expect=overrides[pod.ref], note="expectation set by --expect")
        out.append(pod)
    return tuple(out)
