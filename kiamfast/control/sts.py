"""The one STS client of the control process, and what its failures mean.

Everything kiamfast hands out comes from ``sts:AssumeRole``. This module builds a single
botocore STS client at start-up (a client is thread-safe; a Session is not) and runs
``AssumeRole`` on a small thread pool so the asyncio control loop never blocks on the network.

Where it talks to:
  * region: ``--sts-region``, else ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else
    ``us-east-1``; always the *regional* endpoint (each region has its own throttle);
  * endpoint: ``--sts-endpoint`` if given, else whatever botocore resolves, which honours the
    standard ``AWS_ENDPOINT_URL_STS`` / ``AWS_ENDPOINT_URL`` variables (VPC endpoints, FIPS,
    tests);
  * credentials: botocore's normal chain (the node's instance profile in production, static
    keys in tests).

What a caller gets back is either :class:`Credentials` or one of three error types, because
the credential manager treats them differently:

  * :class:`StsThrottled`: STS said slow down; back off globally, it is account-wide;
  * :class:`StsTransient`: 5xx, timeouts, connection failures, our own credentials missing or
    expired; retry with backoff, answer 503 meanwhile;
  * :class:`StsDenied`: STS refused this request for good (AccessDenied, ValidationError,
    MalformedPolicyDocument, ...); render the IMDS error document and cache it.

botocore does not retry (``standard`` mode, ``max_attempts`` = 1 by default): the manager
does all the backing off, with knowledge of every other key waiting behind this one and of
the node's rate; a retry inside botocore would send a throttled call again at once, past the
node's limiter, to an account that just said slow down.

This module must never log secrets (the client returns them; only the access key ID may be
logged) and never be imported by a worker process.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as _dt
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import botocore.config
import botocore.exceptions
import botocore.session

DEFAULT_REGION = "us-east-1"
MIN_DURATION = 900
MAX_DURATION = 43200

_SESSION_NAME_BAD = re.compile(r"[^\w+=,.@-]", re.ASCII)

THROTTLING_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException",
    "TransactionInProgressException", "RequestLimitExceeded", "BandwidthLimitExceeded",
    "LimitExceededException", "RequestThrottled", "SlowDown", "PriorRequestNotComplete",
    "EC2ThrottledException",
})
TRANSIENT_CODES = frozenset({
    "InternalFailure", "InternalError", "InternalServerError", "ServiceUnavailable",
    "ServiceUnavailableException", "RequestTimeout", "RequestTimeoutException",
    "IDPCommunicationError",
    # Our own identity is the problem, not the role: every role would fail alike, and the
    # node's credentials usually recover (rotation, clock sync). Retry, answer 503.
    "ExpiredToken", "ExpiredTokenException", "InvalidClientTokenId", "SignatureDoesNotMatch",
    "RequestExpired", "UnrecognizedClientException",
})


class StsError(Exception):
    """An AssumeRole that produced no credentials."""

    def __init__(self, code: str, message: str = "", *, role_arn: str = "",
                 status: int | None = None):
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.role_arn = role_arn
        self.status = status


class StsThrottled(StsError):
    """STS throttled us (account-wide per region): back off everything."""


class StsTransient(StsError):
    """A failure that may go away by itself: 5xx, timeout, connection, our own credentials."""


class StsDenied(StsError):
    """A permanent refusal for this request: AccessDenied, ValidationError, bad policy..."""


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str = field(repr=False)
    expiration: _dt.datetime  # timezone-aware UTC
    assumed_role_arn: str = ""

    @property
    def expires_at(self) -> float:
        return self.expiration.timestamp()


def sanitize_session_name(name: str) -> str:
    """A valid ``RoleSessionName``: ``[\\w+=,.@-]``, 2 to 64 characters."""
    clean = _SESSION_NAME_BAD.sub("-", name)[:64]
    return clean if len(clean) >= 2 else (clean + "--")[:2]


def resolve_region(region: str | None = None,
                   environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION


def classify(exc: BaseException, *, role_arn: str = "") -> StsError:
    """Map a botocore exception to StsThrottled / StsTransient / StsDenied."""
    if isinstance(exc, StsError):
        return exc
    if isinstance(exc, botocore.exceptions.ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code") or "Unknown")
        message = str(err.get("Message") or "")
        status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code in THROTTLING_CODES or status == 429:
            return StsThrottled(code, message, role_arn=role_arn, status=status)
        if code in TRANSIENT_CODES or (status is not None and status >= 500):
            return StsTransient(code, message, role_arn=role_arn, status=status)
        return StsDenied(code, message, role_arn=role_arn, status=status)
    if isinstance(exc, botocore.exceptions.ParamValidationError):
        # botocore refused before sending (e.g. an ARN shorter than 20 characters).
        return StsDenied("ValidationError", str(exc), role_arn=role_arn)
    name = type(exc).__name__
    # Connection errors, timeouts, NoCredentialsError, anything unexpected: retry later.
    return StsTransient(name, str(exc), role_arn=role_arn)


class StsClient:
    """One botocore STS client plus the thread pool that runs its calls."""

    def __init__(self, *, region: str | None = None, endpoint_url: str | None = None,
                 max_attempts: int = 1, connect_timeout: float = 2.0,
                 read_timeout: float = 5.0, max_pool_connections: int = 8,
                 session: botocore.session.Session | None = None):
        self.region = resolve_region(region)
        self.max_workers = max(1, max_pool_connections)
        session = session or botocore.session.get_session()
        session.set_config_variable("sts_regional_endpoints", "regional")
        config = botocore.config.Config(
            retries={"mode": "standard", "total_max_attempts": max(1, max_attempts)},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=self.max_workers,
            user_agent_extra="kiamfast",
        )
        self._client = session.create_client("sts", region_name=self.region,
                                             endpoint_url=endpoint_url or None, config=config)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_workers, thread_name_prefix="kiamfast-sts")

    @classmethod
    def from_config(cls, config, **overrides) -> "StsClient":
        """From a ``kiamfast.config.Config`` (``--sts-region``, ``--sts-endpoint``)."""
        kwargs = dict(region=config.sts_region or None,
                      endpoint_url=config.sts_endpoint or None)
        kwargs.update(overrides)
        return cls(**kwargs)

    @property
    def endpoint_url(self) -> str:
        return self._client.meta.endpoint_url

    def assume_role_sync(self, role_arn: str, session_name: str, *,
                         external_id: str | None = None, duration: int = 3600,
                         tags: Sequence[tuple[str, str]] | None = None,
                         transitive: bool = False) -> Credentials:
        """Blocking AssumeRole; raises StsThrottled / StsTransient / StsDenied.
        ``transitive``: every tag is also a TransitiveTagKey (kept through role chaining,
        where the chained session cannot override it), as EKS Pod Identity sends them."""
        params: dict = {
            "RoleArn": role_arn,
            "RoleSessionName": sanitize_session_name(session_name),
            "DurationSeconds": int(min(max(duration, MIN_DURATION), MAX_DURATION)),
        }
        if external_id:
            params["ExternalId"] = external_id
        if tags:
            params["Tags"] = [{"Key": k, "Value": v} for k, v in tags]
            if transitive:
                params["TransitiveTagKeys"] = [k for k, _ in tags]
        try:
            resp = self._client.assume_role(**params)
        except Exception as exc:  # classified below; nothing escapes unclassified
            raise classify(exc, role_arn=role_arn) from exc
        try:
            c = resp["Credentials"]
            expiration = c["Expiration"]
            if expiration.tzinfo is None:
                expiration = expiration.replace(tzinfo=_dt.timezone.utc)
            return Credentials(
                access_key_id=c["AccessKeyId"], secret_access_key=c["SecretAccessKey"],
                session_token=c["SessionToken"],
                expiration=expiration.astimezone(_dt.timezone.utc),
                assumed_role_arn=(resp.get("AssumedRoleUser") or {}).get("Arn", ""))
        except (KeyError, TypeError, AttributeError) as exc:
            raise StsTransient("MalformedResponse", repr(exc), role_arn=role_arn) from exc

    async def assume_role(self, role_arn: str, session_name: str, *,
                          external_id: str | None = None, duration: int = 3600,
                          tags: Sequence[tuple[str, str]] | None = None,
                          transitive: bool = False) -> Credentials:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self.assume_role_sync(
                role_arn, session_name, external_id=external_id, duration=duration, tags=tags,
                transitive=transitive))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._client.close()
        except Exception:  # pragma: no cover - best effort on shutdown
            pass
