"""One STS call for a key, and what its answer does to the key.

The schedule runs :meth:`KeyCalls.fetch` when a key's turn comes; this module makes the
AssumeRole call (on the STS client's thread pool: the event loop never blocks), counts it
and then moves the key on: fresh credentials are written (only with at least
``min_lifetime`` left, sdk-imds.md §4) and refreshed at their time; a failure keeps the old
credentials flowing until they stop being servable (static stability), then the slot turns
to ERROR and workers answer 503.  What an answer writes and logs, and when the key is
called next, is :mod:`.outcomes`; which key holds which slot, :mod:`.slots`.

A throttled key retries when the node's pause ends (no backoff of its own); a throttled call
of a key a pod's request is held for retries once 50-150 ms later, within that wait.  Other
failures back off per key. Permanent refusals (AccessDenied...) become the real-IMDS error
document, cached for ``error_ttl`` (kube2iam's ``--iam-role-error-ttl``, at least
``error_ttl_floor`` so a misconfigured role cannot hammer STS), retried with growing
intervals while pods use them.  A tagged call STS refuses is denied as any refusal, with a
message naming ``sts:TagSession``, and never retried without its tags.  The agent having no
AWS credentials of its own is the node's problem, not a role's: one warning for all roles.

What it must never do: serve credentials with less than ``min_lifetime`` left, leave a key
stuck after an answer it could not publish, or log a secret.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Protocol

from kiamfast import milestones
from kiamfast.control.iam.keys import SessionNaming
from kiamfast.control.iam.metrics import StsMetrics
from kiamfast.control.iam.outcomes import (CallTiming, audit_line, refusal_reason,
                                           write_credentials, write_denied)
from kiamfast.control.iam.schedule import (PRIO_NEW, PRIO_REFRESH, PRIO_WANTED, QUICK_RETRY,
                                           Schedule)
from kiamfast.control.iam.slots import DENIED, ERROR, READY, CredentialTable, KeyEntry
from kiamfast.control.iam.sts import (Credentials, StsDenied, StsError, StsThrottled,
                                      StsTransient, classify)
from kiamfast.table import CRED_ERROR

log = logging.getLogger("kiamfast.credentials")
NO_CREDENTIALS_LOG_EVERY = 30.0


class AssumeRole(Protocol):
    async def assume_role(self, role_arn: str, session_name: str, *,
                          external_id: str | None = None, duration: int = 3600,
                          tags: list[tuple[str, str]] | None = None,
                          transitive: bool = False) -> Credentials: ...


class KeyCalls:
    """A key's STS calls and what their answers do to it (state, table, timers, counts)."""

    def __init__(self, *, sts: AssumeRole, naming: SessionNaming, table: CredentialTable,
                 schedule: Schedule, timing: CallTiming, metrics: StsMetrics,
                 duration: int, min_lifetime: float, base_role_arn: str | None,
                 release_grace: float, clock: Callable[[], float], rng: random.Random,
                 notify: Callable[[], None],
                 set_waiting: Callable[[KeyEntry, bool], None]) -> None:
        self.sts = sts
        self.naming = naming
        self.table = table
        self.schedule = schedule
        self.bucket = schedule.bucket
        self.timing = timing
        self.metrics = metrics
        self.duration = duration
        self.min_lifetime = min_lifetime
        self.base_role_arn = base_role_arn
        self.release_grace = release_grace
        self.clock = clock
        self.rng = rng
        self.notify = notify
        self.set_waiting = set_waiting
        self.counts = {"sts_success": 0, "sts_throttled": 0, "sts_transient": 0,
                       "sts_denied": 0, "refreshes": 0, "issued": 0, "expired": 0}
        self._no_credentials_logged = float("-inf")

    def session_name(self, entry: KeyEntry) -> str:
        """The key's session name as its pods now make it (kube2iam's policy reads them)."""
        return self.naming.session_name(entry.key, entry.users.items())

    async def fetch(self, entry: KeyEntry, ticket: int) -> None:
        """One AssumeRole call for the key (the schedule's ``fetch``), and its answer."""
        key = entry.key
        name = self.session_name(entry)
        started = time.monotonic()
        self.metrics.inflight.set(self.schedule.inflight)
        result: Credentials | StsError
        try:
            result = await self.sts.assume_role(
                key.role_arn, name, external_id=key.external_id, duration=self.duration,
                tags=list(key.tags) or None, transitive=self.naming.eks)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # classified: StsError already, anything else -> transient
            result = classify(exc, role_arn=key.role_arn)
        finally:
            self.schedule.finished(entry)
            self.metrics.inflight.set(self.schedule.inflight)
        elapsed = time.monotonic() - started
        if isinstance(result, Credentials):
            milestones.mark("first STS answer")
            self.metrics.sts_call(key.role_arn, "Success", "success", elapsed)
            self.counts["sts_success"] += 1
            self.schedule.succeeded()
            self.metrics.rate.set(self.bucket.rate)
            if not entry.freed:
                try:
                    self._succeeded(entry, result, name)
                except Exception as exc:  # e.g. ValueTooLarge: never leave the key stuck
                    log.exception("publishing credentials for %s failed", key.role_arn)
                    self.failed(entry, StsTransient(type(exc).__name__, str(exc),
                                                    role_arn=key.role_arn))
            return
        kind = ("throttled" if isinstance(result, StsThrottled) else
                "denied" if isinstance(result, StsDenied) else "transient")
        self.metrics.sts_call(key.role_arn, result.code or "UnknownError", kind, elapsed)
        self.counts[f"sts_{kind}"] += 1
        if isinstance(result, StsThrottled):
            self.schedule.throttled(ticket)
            self.metrics.rate.set(self.bucket.rate)
        if not entry.freed:
            self.failed(entry, result)

    def failed(self, entry: KeyEntry, err: StsError) -> None:
        """The key's call failed (or can never be made): keep serving what is still
        servable, else the error document (refused) or ERROR; then the next attempt."""
        now = self.clock()
        entry.failures += 1
        entry.last_error = err
        denied = isinstance(err, StsDenied)
        if denied:
            entry.denials += 1
        delay = self.timing.retry_delay(err, failures=entry.failures, denials=entry.denials,
                                        paused_for=max(0.0, self.bucket.paused_until - now))
        loud = entry.failures == 1 or entry.failures % 10 == 0
        if err.code == "NoCredentialsError":
            self._no_credentials(now)            # the node's problem, not this role's
        elif not entry.unsendable:
            log.log(logging.WARNING if loud else logging.DEBUG,
                    "AssumeRole failed: role=%s code=%s failures=%d retry_in=%.1fs: %s",
                    entry.key.role_arn, err.code, entry.failures, delay,
                    refusal_reason(entry, err) or err.message)
        if entry.state == READY and now < entry.serve_until:
            # Static stability: keep serving what we have; retry, at the latest at the end.
            retry_at = min(now + delay, entry.serve_until)
            entry.not_before = retry_at
            if entry.idle_since is None:
                if retry_at < entry.serve_until:
                    self.schedule.set_timer(entry, retry_at, "fetch", PRIO_REFRESH)
                else:  # the last chance is at serve_until; expire() retries after it
                    self.schedule.set_timer(entry, entry.serve_until, "expire")
            return
        entry.not_before = now + delay
        if denied:
            self._write_denied(entry, err, now)
            self.set_waiting(entry, False)     # the pod gets its answer: the error document
            entry.creds = None
        else:
            if entry.state == READY:
                self.counts["expired"] += 1
            self.table.set_cred_state(entry.slot, CRED_ERROR)
            entry.state = ERROR
        self.notify()
        if entry.idle_since is None:
            if isinstance(err, StsThrottled) and entry.quick_retry:
                # once per request a worker holds: the next token may be free within its wait
                entry.quick_retry = False
                self.schedule.set_timer(entry, now + self.rng.uniform(*QUICK_RETRY), "fetch",
                                        PRIO_WANTED)
            else:
                self.schedule.set_timer(entry, entry.not_before, "fetch", PRIO_NEW)

    def expire(self, entry: KeyEntry) -> None:
        """serve_until reached with no fresh credentials: stop serving (ERROR -> 503)."""
        now = self.clock()
        if entry.state != READY or now < entry.serve_until:
            return
        self.counts["expired"] += 1
        if isinstance(entry.last_error, StsDenied):
            self._write_denied(entry, entry.last_error, now)
        else:
            self.table.set_cred_state(entry.slot, CRED_ERROR)
            entry.state = ERROR
        entry.creds = None
        self.notify()
        if entry.idle_since is None and not entry.inflight:
            self.schedule.set_timer(entry, max(now, entry.not_before), "fetch", PRIO_NEW)

    def _succeeded(self, entry: KeyEntry, creds: Credentials, session_name: str) -> None:
        now = self.clock()
        expires = creds.expires_at
        serve_until = expires - self.min_lifetime
        if serve_until <= now + 1.0:
            # STS gave less than min_lifetime (clock skew?): never serve it.
            self.failed(entry, StsTransient(
                "ShortLifetime", f"credentials expire at {creds.expiration.isoformat()}",
                role_arn=entry.key.role_arn))
            return
        refreshed = entry.creds is not None
        write_credentials(self.table, entry, creds, base_role_arn=self.base_role_arn, now=now,
                          serve_until=serve_until)
        entry.creds = creds
        entry.state = READY
        entry.serve_until = serve_until
        entry.fetched_at = now
        entry.failures = entry.denials = 0
        entry.last_error = None
        entry.not_before = 0.0
        self.set_waiting(entry, False)
        entry.issued += 1
        self.counts["issued"] += 1
        if refreshed:
            self.counts["refreshes"] += 1
            self.metrics.refreshes.inc()
        entry.refresh_at = self.timing.refresh_at(now, expires, serve_until)
        self.notify()
        audit_line("credentials issued", entry, pods=list(entry.users.items()),
                   session_name=session_name)
        if entry.idle_since is None:
            self.schedule.set_timer(entry, entry.refresh_at, "fetch", PRIO_REFRESH)
        else:
            self.schedule.set_timer(entry, entry.idle_since + self.release_grace, "free")

    def _write_denied(self, entry: KeyEntry, err: StsError, now: float) -> None:
        """The real-IMDS error document for a refused key, served until the next attempt."""
        entry.serve_until = write_denied(self.table, entry, err,
                                         base_role_arn=self.base_role_arn, now=now)
        entry.state = DENIED

    def _no_credentials(self, now: float) -> None:
        """botocore found no credentials of the agent's own: one line for every role, at
        most every NO_CREDENTIALS_LOG_EVERY seconds."""
        if now - self._no_credentials_logged < NO_CREDENTIALS_LOG_EVERY:
            return
        self._no_credentials_logged = now
        log.warning("STS: the agent has no AWS credentials of its own to call AssumeRole with "
                    "(botocore: Unable to locate credentials): give the node an instance role "
                    "(read from the metadata service), or the agent AWS_ACCESS_KEY_ID/"
                    "AWS_SECRET_ACCESS_KEY, a web identity (IRSA) or a profile in its "
                    "environment; retrying, credentials already fetched are served until they "
                    "expire (logged at most every %.0fs)", NO_CREDENTIALS_LOG_EVERY)
