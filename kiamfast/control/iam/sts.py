"""The one STS client of the control process, and what its failures mean.

Everything kiamfast hands out comes from ``sts:AssumeRole``. This module holds a single
botocore STS client (a client is thread-safe; a Session is not) and runs ``AssumeRole`` on a
small thread pool so the asyncio control loop never blocks on the network.

Cheap to import and to build (issue 32): importing this module imports no botocore;
``StsClient.from_config`` builds the client on the pool's thread and returns (the control
process lists pods meanwhile; the first call waits for it), or, with ``start=False``, when
``prepare()`` says so (a restarted control process first lets the runtime's poll confirm the
adopted owners: botocore's imports would take the interpreter from it). The client is botocore's own
(signer, parser, error model, retries, credential chain, proxies, TLS) without what STS does
not need: the 1.2 MB legacy ``endpoints.json`` (8 MiB, ~40 ms) and the loader's walk of
every service directory (~35 ms). STS's endpoint rule set decides URL and signing region;
the legacy table only adds pseudo-regions (``aws-global``, ``us-east-1-fips``) and refuses
some dualstack hosts, so it is loaded as before for those (a region not of the form of a
partition in ``partitions.json``, or dualstack). tests/credentials/test_sts_requests.py
proves the requests equal to the stock client's.

Where it talks to:
  * region: ``--sts-region``, else ``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else
    ``us-east-1``; always the *regional* endpoint (each region has its own throttle):
    ``sts.<region>.amazonaws.com``, ``.amazonaws.com.cn`` in China, FIPS hosts with
    ``AWS_USE_FIPS_ENDPOINT`` / ``use_fips_endpoint``, all as STS's rule set says;
  * endpoint: ``--sts-endpoint`` if given, else what botocore is configured with
    (``AWS_ENDPOINT_URL_STS``, ``AWS_ENDPOINT_URL``, the shared config file's
    ``endpoint_url`` and ``services`` section, unless ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS``);
  * credentials: botocore's normal chain (environment, shared files, web identity, container
    provider, the node's instance profile at 169.254.169.254 or
    ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, not ``--metadata-addr``), refreshed by botocore
    before they expire; a chain that found nothing is asked again at the next call.

What a caller gets back is either :class:`Credentials` or one of three error types, because
the credential manager treats them differently:

  * :class:`StsThrottled`: STS said slow down; back off globally, it is account-wide;
  * :class:`StsTransient`: 5xx, timeouts, connection failures, our own credentials missing or
    expired, a client that could not be built; retry with backoff, answer 503 meanwhile;
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
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kiamfast import milestones
from kiamfast.control.iam.sts_session import assume_role_url, sts_session

log = logging.getLogger("kiamfast.sts")

DEFAULT_REGION = "us-east-1"
MIN_DURATION = 900
MAX_DURATION = 43200
# AssumeRole calls at once (threads, connections; the manager schedules no more): a node
# starting with 100 roles on an STS answering in 30 ms had them all ~0.4 s after the first
# answer, against ~1 s with 8, for ~1 MiB more (bench/node_start.py --sts-latency 0.03).  The
# threads are made as calls need them; the node's budget (--sts-qps/--sts-burst) still sets
# the rate.
CALLS_IN_FLIGHT = 32

_SESSION_NAME_BAD = re.compile(r"[^\w+=,.@-]", re.ASCII)
# botocore's own check of a region name (utils.validate_region_name): a DNS label.
_REGION_NAME = re.compile(r"^(?![0-9]+$)(?!-)[a-zA-Z0-9-]{,63}(?<!-)$")

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
    # Only an exception botocore raised can be one of its types, and then it is loaded:
    # looking it up here keeps this module free of botocore until the client is built.
    errors: Any = sys.modules.get("botocore.exceptions")
    if errors is not None and isinstance(exc, errors.ClientError):
        err = exc.response.get("Error", {}) or {}
        code = str(err.get("Code") or "Unknown")
        message = str(err.get("Message") or "")
        status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if code in THROTTLING_CODES or status == 429:
            return StsThrottled(code, message, role_arn=role_arn, status=status)
        if code in TRANSIENT_CODES or (status is not None and status >= 500):
            return StsTransient(code, message, role_arn=role_arn, status=status)
        return StsDenied(code, message, role_arn=role_arn, status=status)
    if errors is not None and isinstance(exc, errors.ParamValidationError):
        # botocore refused before sending (e.g. an ARN shorter than 20 characters).
        return StsDenied("ValidationError", str(exc), role_arn=role_arn)
    name = type(exc).__name__
    # Connection errors, timeouts, NoCredentialsError, anything unexpected: retry later.
    return StsTransient(name, str(exc), role_arn=role_arn)


class StsClient:
    """One botocore STS client plus the thread pool that runs its calls."""

    def __init__(self, *, region: str | None = None, endpoint_url: str | None = None,
                 max_attempts: int = 1, connect_timeout: float = 2.0,
                 read_timeout: float = 5.0, max_pool_connections: int = CALLS_IN_FLIGHT,
                 session: Any = None, defer: bool = False):
        """``defer``: build the botocore client on the pool's thread (started by
        ``prepare()`` or the first call) instead of before returning; a failure to build is
        then raised by the calls (classified StsTransient), each of which tries again."""
        self.region = resolve_region(region)
        if not _REGION_NAME.match(self.region):
            raise ValueError(f"not a region name: {self.region!r} (--sts-region, "
                             f"AWS_REGION or AWS_DEFAULT_REGION)")
        self.max_workers = max(1, max_pool_connections)
        self._endpoint_arg = endpoint_url or None
        self._max_attempts = max(1, max_attempts)
        self._timeouts = (connect_timeout, read_timeout)
        self._session = session
        self._client: Any = None
        self._built = False
        self._endpoint = ""
        self._closed = False
        self._build_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_workers, thread_name_prefix="kiamfast-sts")
        self._background: concurrent.futures.Future | None = None
        if not defer:
            self.load()

    @classmethod
    def from_config(cls, config, *, start: bool = True, **overrides) -> "StsClient":
        """From a ``kiamfast.config.Config`` (``--sts-region``, ``--sts-endpoint``); the
        botocore client is built in the background (``defer``), from now on, or with
        ``start=False`` from ``prepare()``."""
        kwargs = dict(region=config.sts_region or None,
                      endpoint_url=config.sts_endpoint or None, defer=True)
        kwargs.update(overrides)
        client = cls(**kwargs)
        if start:
            client.prepare()
        return client

    # ---- building the botocore client -------------------------------------------------------

    def prepare(self) -> None:
        """Start building the botocore client on the pool's thread, unless that has begun
        (or a call built it)."""
        if self._background is None and self._client is None and not self._closed:
            self._background = self._pool.submit(self._load_quietly)

    def load(self) -> Any:
        """The botocore client, built now if it is not yet (blocking; safe from any thread).
        A build started by ``defer`` is waited for, not raced."""
        client = self._client
        if client is not None:
            return client
        if self._background is not None:
            concurrent.futures.wait([self._background])
        return self._build_once()

    def _build_once(self) -> Any:
        with self._build_lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def _load_quietly(self) -> None:
        try:
            self._build_once()
        except Exception as exc:  # the first call raises it again, classified
            log.warning("STS client not built yet (%s: %s); the next call tries again",
                        type(exc).__name__, exc)

    def _build(self) -> Any:
        """A client from a new session (or the one given): nothing a failed build read
        (a profile, a credential chain that found nothing) outlives it."""
        started = time.monotonic()
        import botocore.config
        import botocore.configprovider

        session = self._session or sts_session(self.region)
        session.set_config_variable("sts_regional_endpoints", "regional")
        endpoint = self._endpoint_arg
        if endpoint is None and not session.get_config_variable(
                "ignore_configured_endpoint_urls"):
            endpoint = botocore.configprovider.ConfiguredEndpointProvider(
                full_config=session.full_config, scoped_config=session.get_scoped_config(),
                client_name="sts").provide()
        connect_timeout, read_timeout = self._timeouts
        config = botocore.config.Config(
            retries={"mode": "standard", "total_max_attempts": self._max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=self.max_workers,
            user_agent_extra="kiamfast",
        )
        client = session.create_client("sts", region_name=self.region, endpoint_url=endpoint,
                                       config=config)
        # Not client.meta.endpoint_url: that is the legacy table's answer (a guess without
        # the table), which STS's rule set overrides for every call.
        self._endpoint = endpoint or assume_role_url(client)
        # Built again after each NoCredentialsError (_forget): said once, then in debug.
        log.log(logging.DEBUG if self._built else logging.INFO,
                "STS client for %s at %s built in %.0f ms", self.region, self._endpoint,
                (time.monotonic() - started) * 1000)
        self._built = True
        milestones.mark("STS client built")
        if self._closed:
            client.close()
        return client

    @property
    def endpoint_url(self) -> str:
        """Where AssumeRole goes: the endpoint given or configured, else the client's own
        resolution (builds the client if it is not yet)."""
        self.load()
        return self._endpoint

    # ---- calls ------------------------------------------------------------------------------

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
        client = None
        try:
            client = self.load()
            resp = client.assume_role(**params)
        except Exception as exc:  # classified below; nothing escapes unclassified
            error = classify(exc, role_arn=role_arn)
            if error.code == "NoCredentialsError" and client is not None:
                self._forget(client)
            raise error from exc
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

    def _forget(self, client: Any) -> None:
        """botocore gives a client the credentials its session found when it was built, and
        none later: a client built before any were found is dropped (not closed: other
        calls may hold it), and the next call builds one whose session asks again."""
        with self._build_lock:
            if self._client is client:
                self._client = None

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
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        client = self._client
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover - best effort on shutdown
                pass
