"""The demo's judge: did a pod get exactly the identity it should have, and nothing else?

Why it exists: the demo is only worth running if it can fail. Everything it claims ("each
pod got its own role") is decided here, from what a pod's real botocore client observed
(:mod:`kiamfast.demo.pod`), never from what the agent says about itself: the role counts as
received only when the local STS, asked ``GetCallerIdentity`` with the pod's credentials,
names it.

Rules (:func:`judge`):

* Every connection of the pod client must have left from the pod's address; otherwise the
  run proves nothing (the agent identifies pods by source address) and fails.
* The node's own credentials (the fake metadata service marks them ``ASIANODE...``) are
  always wrong, whatever was expected.
* A pod expected to get a role must have received credentials through the metadata
  provider (botocore's ``iam-role``), and STS must name an assumed role with the expected
  account and role name.
* A pod expected to get nothing must have received no credentials, and the agent must have
  refused it (404 on the role listing), not merely been unavailable (503) or silent.

This module is pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Verdict", "assumed_role", "judge", "role_identity"]

NODE_KEY_PREFIX = "ASIANODE"

_ASSUMED = re.compile(r"arn:aws[\w-]*:sts::(\d{12}):assumed-role/([^/]+)/(.+)")
_ROLE = re.compile(r"arn:aws[\w-]*:iam::(\d{12}):role/(?:.*/)?([^/]+)")


@dataclass(frozen=True)
class Verdict:
    """The judgement of one pod run.

    ``received`` is what the pod got in a word or two (a role name, ``none``), ``account``
    the account of a received role, ``problem`` why it is wrong (None when ``ok``).
    """

    ok: bool
    received: str
    account: str | None = None
    problem: str | None = None


def assumed_role(arn: str | None) -> tuple[str, str, str] | None:
    """``arn:aws:sts::ACCOUNT:assumed-role/NAME/SESSION`` -> (account, name, session)."""
    m = _ASSUMED.fullmatch(arn or "")
    return (m.group(1), m.group(2), m.group(3)) if m else None


def role_identity(role_arn: str) -> tuple[str, str]:
    """An IAM role ARN -> (account, role name without its path), as STS reports it."""
    m = _ROLE.fullmatch(role_arn)
    if m is None:
        raise ValueError(f"not an IAM role ARN: {role_arn!r}")
    return m.group(1), m.group(2)


def judge(expected_role_arn: str | None, observed: dict, *, ip: str) -> Verdict:
    """Judge one pod run (``observed`` is :func:`kiamfast.demo.pod.run`'s dict).

    ``expected_role_arn``: the IAM role ARN the pod must get, or None when it must get none.
    """
    if observed.get("crashed"):
        return Verdict(False, "?", problem=f"the pod client failed: {observed['crashed']}")
    sources = observed.get("sources") or []
    foreign = [s for s in sources if s != ip]
    if foreign:
        return Verdict(False, "?", problem=f"connections left from {', '.join(foreign)}, "
                                           f"not from the pod's address {ip}")
    access_key = observed.get("access_key")
    identity = assumed_role(observed.get("arn"))
    if access_key:
        if access_key.startswith(NODE_KEY_PREFIX):
            return Verdict(False, "the NODE's role", problem="got the node's own credentials")
        if identity is None:
            what = observed.get("arn") or observed.get("sts_error") or "no answer"
            return Verdict(False, "unverified",
                           problem=f"credentials that STS does not know as a role ({what})")
        account, name, _ = identity
        if observed.get("method") != "iam-role":
            return Verdict(False, name, account=account,
                           problem=f"credentials came from {observed.get('method')!r}, "
                                   f"not from the metadata service")
        if expected_role_arn is None:
            return Verdict(False, name, account=account,
                           problem="got a role but should have been refused")
        want_account, want_name = role_identity(expected_role_arn)
        if (account, name) != (want_account, want_name):
            return Verdict(False, name, account=account,
                           problem=f"wrong role: expected {want_name}"
                                   + (f" in {want_account}" if want_account != account else ""))
        return Verdict(True, name, account=account)
    status = observed.get("listing_status")
    error = observed.get("error")
    received = "none" if status is None else f"none ({status})"
    if expected_role_arn is not None:
        why = f"no credentials ({error})" if error else "no credentials"
        if status is not None:
            why += f"; the agent answered {status}"
        return Verdict(False, received, problem=why)
    if status != 404:
        return Verdict(False, received,
                       problem="no credentials, but the agent did not refuse (404): "
                               + ("no answer" if status is None else f"it answered {status}"))
    if error:
        return Verdict(False, received, problem=f"the SDK failed instead of finding no "
                                                f"credentials ({error})")
    return Verdict(True, "refused (404)")
