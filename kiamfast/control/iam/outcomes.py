"""What an STS answer leaves behind: the bytes in the key's slot, the words said, the next call.

Credentials are written as the parts workers serve plus the key part (``credential_parts.PART_KEY``:
the key and expiry, no secret, so a restarted control process can adopt the slot).  A
permanent refusal is written as the real-IMDS error document, served until the next
attempt replaces it.  A refused tagged call most likely lacks ``sts:TagSession``: STS says
so only in its message, which pods never see, so the reason names it.  Every issued or
shared credential gets one ``kiamfast.audit`` line.

When the key is called next (:class:`CallTiming`): credentials are refreshed ahead of time
(half-life, jittered so keys fetched together spread out); a throttled key waits for the
node's pause and no more; a refused one for ``error_ttl`` doubling up to ``error_ttl_max``
(kube2iam's ``--iam-role-error-ttl``: a misconfigured role cannot hammer STS); any other
failure backs off per key.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from kiamfast.budget import backoff
from kiamfast import credential_parts
from kiamfast.control.iam.keys import TAGSESSION_HINT, CredentialRequest
from kiamfast.control.iam.slots import CredentialTable, KeyEntry
from kiamfast.control.iam.sts import Credentials, StsDenied, StsError, StsThrottled
from kiamfast.table import CRED_READY

audit = logging.getLogger("kiamfast.audit")

# Far enough that an error document is never reported EXPIRED by the table; it is replaced
# by the next attempt anyway.
ERROR_DOC_LIFETIME = 365 * 86400.0


def write_credentials(table: CredentialTable, entry: KeyEntry, creds: Credentials, *,
                      base_role_arn: str | None, now: float, serve_until: float) -> None:
    """The parts workers serve for the key's new credentials, and the key part."""
    parts = credential_parts.render_credentials(
        role_arn=entry.key.role_arn, base_role_arn=base_role_arn,
        access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key,
        session_token=creds.session_token, expiration=creds.expiration,
        last_updated=now)
    parts.append(credential_parts.key_part(
        role_arn=entry.key.role_arn, external_id=entry.key.external_id,
        session=entry.key.session, tags=entry.key.tags,
        access_key_id=creds.access_key_id, expiration=creds.expires_at, fetched_at=now))
    table.write_cred(entry.slot, parts, serve_until=serve_until, state=CRED_READY)


def write_denied(table: CredentialTable, entry: KeyEntry, err: StsError, *,
                 base_role_arn: str | None, now: float) -> float:
    """The real-IMDS error document for a refused key; returns until when it is served."""
    serve_until = now + ERROR_DOC_LIFETIME
    parts = credential_parts.render_error(role_arn=entry.key.role_arn, code=err.code,
                                last_updated=now, base_role_arn=base_role_arn,
                                reason=refusal_reason(entry, err))
    parts.append(credential_parts.key_part(
        role_arn=entry.key.role_arn, external_id=entry.key.external_id,
        session=entry.key.session, tags=entry.key.tags, access_key_id="",
        expiration=serve_until, fetched_at=now, denied=True))
    table.write_cred(entry.slot, parts, serve_until=serve_until, state=CRED_READY)
    return serve_until


def refusal_reason(entry: KeyEntry, err: StsError) -> str:
    """What the pod and the log are told beyond the code: a refused tagged call most
    likely lacks sts:TagSession (STS says so in its message, pods never see it)."""
    if entry.unsendable:
        return err.message
    if entry.key.tags and err.code == "AccessDenied":
        return f"{TAGSESSION_HINT} ({err.message})" if err.message else TAGSESSION_HINT
    return ""


def audit_line(event: str, entry: KeyEntry, *, pods: list[tuple[str, CredentialRequest]],
               session_name: str) -> None:
    """One ``kiamfast.audit`` line: which pods were given which credentials (no secret)."""
    creds = entry.creds
    if creds is None:
        return
    fields = {
        "event": event.replace(" ", "_"),
        "role_arn": entry.key.role_arn,
        "access_key_id": creds.access_key_id,
        "expiration": credential_parts.imds_time(creds.expiration),
        "session_name": session_name,
        "external_id": bool(entry.key.external_id),
        "slot": entry.slot,
        "pods": sorted(f"{r.namespace}/{r.pod_name}" for _, r in pods),
        "pod_uids": sorted(uid for uid, _ in pods),
        "namespaces": sorted({r.namespace for _, r in pods}),
    }
    audit.info("%s role=%s access_key_id=%s expiration=%s pods=%s", event,
               fields["role_arn"], fields["access_key_id"], fields["expiration"],
               ",".join(fields["pods"]), extra={"audit": fields})


@dataclass(frozen=True)
class CallTiming:
    """When a key's next STS call is due after an answer."""

    refresh_fraction: float
    refresh_jitter: float
    error_ttl: float
    error_ttl_max: float
    backoff_base: float
    backoff_max: float
    rng: random.Random

    def refresh_at(self, fetched_at: float, expires: float, serve_until: float) -> float:
        """Refresh at half-life, but leave at least a third of the serving window for retries
        when the session is short; jitter spreads keys fetched together."""
        ahead = min((expires - fetched_at) * self.refresh_fraction,
                    (serve_until - fetched_at) * 2 / 3)
        ahead -= self.rng.uniform(0.0, self.refresh_jitter * ahead)
        return fetched_at + ahead

    def retry_delay(self, err: StsError, *, failures: int, denials: int,
                    paused_for: float) -> float:
        """How long a key waits after its ``failures``-th failure in a row: a throttled one
        for the node's pause (``paused_for``), no more; a refused one (its ``denials``-th
        refusal) for the error TTL, doubling; any other with a jittered backoff."""
        if isinstance(err, StsThrottled):
            return paused_for
        if isinstance(err, StsDenied):
            return min(self.error_ttl_max, self.error_ttl * 2 ** (denials - 1))
        return backoff(failures, base=self.backoff_base, cap=self.backoff_max, rng=self.rng)
