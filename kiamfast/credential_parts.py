"""Pre-rendered HTTP responses for one credential slot (the "parts").

Workers answer a credential request by copying bytes out of shared memory and writing them to
the socket: no JSON encoding, no header formatting, no clock reads on the hot path. That only
works if everything a response needs is decided here, in the control process, once per STS
fetch. This module turns a role ARN plus one set of STS credentials (or one permanent STS
failure) into the list of parts described in docs/architecture.md:

    PART_NAMES         the role names a URL may use, ``\\n``-separated; the first is listed
    PART_LISTING       full HTTP response, body = the listing name
    PART_DOCUMENT      full HTTP response, the IMDS credentials document
    PART_EXT_DOCUMENT  full HTTP response, the document plus ``AccountId`` (IMDS spec 2.1)
    PART_INFO          full HTTP response, ``iam/info`` for the pod's role
    PART_KEY           the key the slot holds credentials for, and their expiry (no secret)

What it must never do: put a ``Date`` header or anything else time-of-request into the bytes
(they are served for up to an hour), emit an ``Expiration`` in any form but
``YYYY-MM-DDTHH:MM:SSZ`` (the one form every SDK parses, and the one botocore's static
stability logic needs), or put an STS error message into a response (STS messages name the
node's own role and instance; they go to the control process's log instead).

It imports nothing heavier than orjson and the table's constants.
"""
from __future__ import annotations

import base64
import datetime as _dt
import hashlib
from email.utils import formatdate
from typing import Any

import orjson

from kiamfast.table import PART_KEY

PART_COUNT = PART_KEY + 1

#: The table copies at most this many bytes of PART_NAMES when matching a URL name.
NAMES_LIMIT = 1024

#: Real IMDS's code for "the instance profile's role cannot be assumed".
ERROR_CODE = "AssumeRoleUnauthorizedAccess"

_STATUS_LINE = b"HTTP/1.1 200 OK\r\n"


class RenderError(ValueError):
    """The inputs cannot be turned into a valid response (e.g. a naive datetime)."""


# ---- small helpers ------------------------------------------------------------------------------

def _epoch(value: float | _dt.datetime) -> float:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            raise RenderError("datetimes must be timezone-aware")
        return value.timestamp()
    return float(value)


def imds_time(value: float | _dt.datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SSZ`` in UTC, fraction truncated (what IMDS and every SDK expect)."""
    return _dt.datetime.fromtimestamp(int(_epoch(value)), _dt.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def http_date(value: float | _dt.datetime) -> str:
    """RFC 7231 IMF-fixdate, e.g. ``Tue, 07 May 2026 12:00:00 GMT``."""
    return formatdate(int(_epoch(value)), usegmt=True)


def http_response(body: bytes, *, last_modified: float | _dt.datetime) -> bytes:
    """A complete ``200 OK`` HTTP/1.1 response in real IMDS's header style.

    No ``Date`` (it would go stale) and no ``Connection`` header (keep-alive is the HTTP/1.1
    default; a worker that must close says so itself). The header block ends with the usual
    blank line, so a worker that must add a header (e.g. the IMDSv2 token TTL) can splice it
    in before the first ``\\r\\n\\r\\n``.
    """
    head = (
        "Content-Type: text/plain\r\n"
        "Accept-Ranges: none\r\n"
        f"Last-Modified: {http_date(last_modified)}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Server: EC2ws\r\n"
        "\r\n"
    ).encode("ascii")
    return _STATUS_LINE + head + body


# ---- role identity ------------------------------------------------------------------------------

def _arn_fields(role_arn: str) -> tuple[str, str, str] | None:
    """(partition, account, resource) of an IAM ARN, or None if it is not one."""
    fields = role_arn.split(":", 5)
    if len(fields) != 6 or fields[0].lower() != "arn":
        return None
    return fields[1], fields[4], fields[5]


def role_name(role_arn: str) -> str:
    """The listing name: the last ``/`` segment of the ARN (sdk-imds §6)."""
    return role_arn.rsplit("/", 1)[-1] if "/" in role_arn else role_arn


def account_id(role_arn: str) -> str | None:
    fields = _arn_fields(role_arn)
    if fields is None or not fields[1].isdigit():
        return None
    return fields[1]


def role_names(role_arn: str, base_role_arn: str | None = None) -> list[str]:
    """Every name a URL may use for this role, listing name first.

    1. the role name (last ARN segment), what we list and what SDKs send back;
    2. kube2iam's listing form: the ARN with the base-ARN prefix stripped (may contain a
       path such as ``team/app``), for clients that remembered a kube2iam listing;
    3. the full ARN (kube2iam lists cross-account roles that way).

    Duplicates are dropped; names are cut off where the table's matcher would stop reading.
    """
    names = [role_name(role_arn)]
    if base_role_arn:
        base = base_role_arn if base_role_arn.endswith("/") else base_role_arn + "/"
        if role_arn.startswith(base) and len(role_arn) > len(base):
            names.append(role_arn[len(base):])
    names.append(role_arn)
    out: list[str] = []
    size = 0
    for name in names:
        if not name or name in out or "\n" in name:
            continue
        extra = len(name.encode()) + (1 if out else 0)
        if size + extra > NAMES_LIMIT:
            break
        out.append(name)
        size += extra
    return out


def instance_profile_arn(role_arn: str) -> str:
    fields = _arn_fields(role_arn)
    partition, account = (fields[0], fields[1]) if fields else ("aws", "000000000000")
    return f"arn:{partition}:iam::{account}:instance-profile/{role_name(role_arn)}"


def instance_profile_id(role_arn: str) -> str:
    """``AIPA`` + 17 characters, deterministic from the ARN (real IDs are opaque)."""
    digest = hashlib.sha256(role_arn.encode()).digest()
    return "AIPA" + base64.b32encode(digest).decode("ascii")[:17]


# ---- documents ----------------------------------------------------------------------------------

def credentials_document(*, access_key_id: str, secret_access_key: str, session_token: str,
                         expiration: float | _dt.datetime,
                         last_updated: float | _dt.datetime,
                         account: str | None = None) -> bytes:
    """The IMDS credentials JSON in real IMDS's key order (plus AccountId when given)."""
    doc = {
        "Code": "Success",
        "LastUpdated": imds_time(last_updated),
        "Type": "AWS-HMAC",
        "AccessKeyId": access_key_id,
        "SecretAccessKey": secret_access_key,
        "Token": session_token,
        "Expiration": imds_time(expiration),
    }
    if account is not None:
        doc["AccountId"] = account
    return orjson.dumps(doc)


def error_document(*, role_arn: str, code: str, last_updated: float | _dt.datetime,
                   reason: str = "") -> bytes:
    """Real IMDS's answer when the role cannot be assumed (200, ``Code`` not ``Success``);
    ``reason`` says what to fix when kiamfast knows more than the code."""
    why = f"{code}: {reason}" if reason else code
    message = (f"kiamfast cannot assume the role {role_name(role_arn)} ({why}). Please see "
               "documentation at http://docs.amazonwebservices.com/IAM/latest/UserGuide/"
               "RolesTroubleshooting.html.")
    return orjson.dumps({"Code": ERROR_CODE, "Message": message,
                         "LastUpdated": imds_time(last_updated)})


def info_document(*, role_arn: str, last_updated: float | _dt.datetime) -> bytes:
    return orjson.dumps({
        "Code": "Success",
        "LastUpdated": imds_time(last_updated),
        "InstanceProfileArn": instance_profile_arn(role_arn),
        "InstanceProfileId": instance_profile_id(role_arn),
    })


# ---- parts --------------------------------------------------------------------------------------

def _common(role_arn: str, base_role_arn: str | None,
            last_updated: float | _dt.datetime) -> tuple[bytes, bytes, bytes]:
    names = role_names(role_arn, base_role_arn)
    names_part = "\n".join(names).encode()
    listing = http_response(names[0].encode(), last_modified=last_updated)
    info = http_response(info_document(role_arn=role_arn, last_updated=last_updated),
                         last_modified=last_updated)
    return names_part, listing, info


def render_credentials(*, role_arn: str, access_key_id: str, secret_access_key: str,
                       session_token: str, expiration: float | _dt.datetime,
                       last_updated: float | _dt.datetime,
                       base_role_arn: str | None = None) -> list[bytes]:
    """The five parts for a role with working credentials, in PART_* order."""
    names_part, listing, info = _common(role_arn, base_role_arn, last_updated)
    common = dict(access_key_id=access_key_id, secret_access_key=secret_access_key,
                  session_token=session_token, expiration=expiration,
                  last_updated=last_updated)
    document = http_response(credentials_document(**common), last_modified=last_updated)
    ext = http_response(credentials_document(**common, account=account_id(role_arn) or ""),
                        last_modified=last_updated)
    return [names_part, listing, document, ext, info]


def render_error(*, role_arn: str, code: str, last_updated: float | _dt.datetime,
                 base_role_arn: str | None = None, reason: str = "") -> list[bytes]:
    """The five parts for a role STS refused for good (AccessDenied, ValidationError...).

    The listing still lists the name and ``iam/info`` still describes it, as real IMDS does;
    both documents carry the ``AssumeRoleUnauthorizedAccess`` error with status 200.
    """
    names_part, listing, info = _common(role_arn, base_role_arn, last_updated)
    document = http_response(error_document(role_arn=role_arn, code=code,
                                            last_updated=last_updated, reason=reason),
                             last_modified=last_updated)
    return [names_part, listing, document, document, info]


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Split a rendered response into (status, headers, body). For tests and debugging."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body



def key_part(*, role_arn: str, external_id: str | None, session: str,
             tags: tuple[tuple[str, str], ...], access_key_id: str, expiration: float,
             fetched_at: float, denied: bool = False) -> bytes:
    """PART_KEY: what a restarted control process needs to adopt a slot (no secrets)."""
    return orjson.dumps({"v": 1, "role_arn": role_arn, "external_id": external_id,
                         "session": session, "tags": [list(t) for t in tags],
                         "access_key_id": access_key_id, "expiration": expiration,
                         "fetched_at": fetched_at, "denied": denied})


def parse_key_part(parts: list[bytes]) -> dict[str, Any] | None:
    """PART_KEY of a slot's parts as written by key_part, or None if absent or malformed."""
    if len(parts) <= PART_KEY:
        return None
    try:
        record = orjson.loads(parts[PART_KEY])
        if record.get("v") != 1:
            return None
        out = {"role_arn": str(record["role_arn"]),
               "external_id": None if record["external_id"] is None
               else str(record["external_id"]),
               "session": str(record["session"]),
               "tags": [(str(k), str(v)) for k, v in record["tags"]],
               "access_key_id": str(record["access_key_id"]),
               "expiration": float(record["expiration"]),
               "fetched_at": float(record["fetched_at"]),
               "denied": bool(record["denied"])}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return out
