"""The agent's own client of the real metadata service (--metadata-addr).

Used for the health check (kube2iam's /healthz reports the instance ID) and for
--auto-discover-base-arn / --auto-discover-default-role.  IMDSv2 first (a token PUT), with a
fall back to IMDSv1 when the PUT is refused as botocore does (403/404/405).  Blocking
http.client calls with short timeouts: run them in an executor.
"""

from __future__ import annotations

import http.client
import logging

import orjson

from kiamfast.config import Config, split_host_port

log = logging.getLogger("kiamfast.control")

TIMEOUT = 1.0


class ImdsError(Exception):
    """The metadata service could not be read."""


def _request(addr: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = split_host_port(addr)
    conn = http.client.HTTPConnection(host, port or 80, timeout=TIMEOUT)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException, ValueError) as e:
        # A refused or dropped connection, and garbage too (a truncated body, a bad status
        # line): the metadata service is outside, its answers are input like any other.
        raise ImdsError(f"{method} http://{addr}{path}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()


def get(addr: str, path: str) -> bytes:
    """GET a metadata path with an IMDSv2 token (IMDSv1 if tokens are refused)."""
    status, token = _request(addr, "PUT", "/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    headers = {}
    if status == 200:
        headers["X-aws-ec2-metadata-token"] = _text(token, "the token")
    elif status not in (403, 404, 405):
        raise ImdsError(f"token request answered {status}")
    status, body = _request(addr, "GET", path, headers)
    if status != 200:
        raise ImdsError(f"GET {path} answered {status}")
    return body


def _text(body: bytes, what: str) -> str:
    try:
        return body.decode().strip()
    except UnicodeDecodeError:
        raise ImdsError(f"{what} is not text") from None


def instance_id(addr: str) -> str:
    return _text(get(addr, "/latest/meta-data/instance-id"), "instance-id")


def instance_role_arn(addr: str) -> str:
    """The role of the node's instance profile, derived from iam/info as kube2iam does."""
    try:
        info = orjson.loads(get(addr, "/latest/meta-data/iam/info"))
        profile = str(info.get("InstanceProfileArn", ""))
    except (orjson.JSONDecodeError, AttributeError):
        raise ImdsError("iam/info is not a JSON object") from None
    # arn:aws:iam::123456789012:instance-profile/path/name -> the role shares the account
    # and name; kube2iam reads the role name from security-credentials/.
    prefix = profile.split(":instance-profile/")[0]
    name = _text(get(addr, "/latest/meta-data/iam/security-credentials/"), "the role listing")
    if not prefix.startswith("arn:") or not name:
        raise ImdsError(f"cannot derive the instance role from {profile!r}")
    return f"{prefix}:role/{name}"


def discover_roles(config: Config) -> Config:
    """kube2iam's --auto-discover-base-arn / --auto-discover-default-role: read the node's
    own instance role from the metadata service.  Fatal if it cannot be read, as in kube2iam."""
    role_arn = instance_role_arn(config.metadata_addr)
    base = role_arn.split(":role/")[0] + ":role/"
    # The flags are done with once their values are read (the configuration's checks refuse
    # --auto-discover-* beside the values they would set).
    if config.auto_discover_default_role:
        log.info("using the instance role %s as default role", role_arn)
        return config.replace(base_role_arn=base, default_role=role_arn,
                              auto_discover_default_role=False, auto_discover_base_arn=False)
    log.info("discovered base role ARN %s", base)
    return config.replace(base_role_arn=base, auto_discover_base_arn=False)
