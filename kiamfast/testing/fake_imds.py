"""A fake EC2 instance-metadata service for tests and demos.

kiamfast sits in front of the real metadata service and passes most paths through to it.
Tests need an upstream that behaves like IMDS (IMDSv2 token PUT, the usual metadata paths,
the *node's* role and credentials) and, above all, one that **records every request it
gets**: the strongest assertion about the agent is that a pod's request for ``iam/``,
``identity-credentials/`` or ``user-data`` never arrives here at all.

Everything this service hands out that a pod must never see is marked: the node's
credentials have an AccessKeyId starting ``ASIANODE`` and the user data contains
``NODE-SECRET``, so a test can grep any response for a leak.

Run it in-process (``with FakeImds() as imds: imds.url``) on 127.0.0.1 with a free port, or
as a process bound anywhere, e.g. 169.254.169.254:80 inside a network namespace::

    python -m kiamfast.testing.fake_imds --host 169.254.169.254 --port 80 [--log-requests]

It must never be pointed at, or mistaken for, the real 169.254.169.254 of a host: it only
ever binds the address it is given.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiamfast.testing.background import BackgroundServer

TOKEN_MODES = ("optional", "required", "v1-only")


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    client: str
    at: float = field(default_factory=time.monotonic)   # when it arrived

    @property
    def token(self) -> str | None:
        return self.headers.get("x-aws-ec2-metadata-token")


@dataclass
class NodeIdentity:
    """What the fake service knows about "its" instance (all of it the node's, not a pod's)."""

    instance_id: str = "i-0fa4e1a5e0000cafe"
    instance_type: str = "m6i.large"
    ami_id: str = "ami-0123456789abcdef0"
    region: str = "eu-west-1"
    availability_zone: str = "eu-west-1b"
    availability_zone_id: str = "euw1-az2"
    local_ipv4: str = "10.0.12.34"
    account_id: str = "111122223333"
    node_role: str = "eks-node-role"
    user_data: bytes = b"#!/bin/bash\n# NODE-SECRET bootstrap\n"
    node_access_key: str = "ASIANODEROLEDONOTLEAK"
    extra: dict[str, str] = field(default_factory=dict)  # more meta-data paths -> values


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    server_version = "EC2ws"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        pass

    def version_string(self) -> str:
        return "EC2ws"

    # One entry point for every method: record, then answer.
    def _handle(self) -> None:
        fake = self.server.fake
        headers = {k.lower(): v for k, v in self.headers.items()}
        length = int(headers.get("content-length") or 0)
        if length:
            self.rfile.read(min(length, 1 << 20))
        rec = RecordedRequest(self.command, self.path, headers, self.client_address[0])
        fake._record(rec)
        if fake.delay:
            time.sleep(fake.delay)
        status, body, ctype, extra = fake._answer(rec)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.close_connection = True

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = do_OPTIONS = do_PATCH = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    fake: "FakeImds"


class FakeImds(BackgroundServer):
    """An in-process fake IMDS on ``host:port`` (port 0: a free one) that records requests."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 token_mode: str = "optional", identity: NodeIdentity | None = None,
                 token_put_status: int = 403, delay: float = 0.0,
                 log_requests: bool = False) -> None:
        if token_mode not in TOKEN_MODES:
            raise ValueError(f"token_mode must be one of {TOKEN_MODES}")
        self.host = host
        self.requested_port = port
        self.token_mode = token_mode
        self.token_put_status = token_put_status  # the PUT answer in "v1-only" mode
        self.identity = identity or NodeIdentity()
        self.delay = delay
        self.log_requests = log_requests
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []
        self._tokens: dict[str, float] = {}

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> "FakeImds":
        server = _Server((self.host, self.requested_port), _Handler)
        server.fake = self
        self._serve(server, name="fake-imds")
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.server_address[1]

    @property
    def addr(self) -> str:
        """``host:port`` as the agent's ``--metadata-addr`` wants it."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- what happened ----------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def _record(self, rec: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(rec)
        if self.log_requests:
            print(json.dumps({"method": rec.method, "path": rec.path, "headers": rec.headers,
                              "client": rec.client}), flush=True)

    # -- behaviour --------------------------------------------------------------------

    def _answer(self, rec: RecordedRequest) -> tuple[int, bytes, str, list[tuple[str, str]]]:
        path = rec.path.split("?", 1)[0]
        segs = [s for s in path.split("/") if s]
        rest = "/".join(segs[1:])
        if rest == "api/token":
            return self._token_put(rec)
        if self.token_mode != "v1-only":
            token = rec.token
            if token is not None:
                with self._lock:
                    expiry = self._tokens.get(token)
                if expiry is None or expiry < time.time():
                    return 401, b"", "text/plain", []
            elif self.token_mode == "required":
                return 401, b"", "text/plain", []
        if rec.method not in ("GET", "HEAD"):
            return 405, b"", "text/plain", []
        value = self._value(rest, trailing=path.endswith("/"))
        if value is None:
            return 404, b"<?xml version=\"1.0\"?>404 - Not Found\n", "text/html", []
        body, ctype = value
        return 200, body, ctype, [("Accept-Ranges", "none"),
                                  ("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")]

    def _token_put(self, rec: RecordedRequest) -> tuple[int, bytes, str, list[tuple[str, str]]]:
        if rec.method != "PUT":
            return 405, b"", "text/plain", [("Allow", "OPTIONS, PUT")]
        if self.token_mode == "v1-only":
            return self.token_put_status, b"", "text/plain", []
        if "x-forwarded-for" in rec.headers:
            return 403, b"", "text/plain", []
        raw = rec.headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
        if not raw.isdigit() or not 1 <= int(raw) <= 21600:
            return 400, b"", "text/plain", []
        token = secrets.token_urlsafe(42)
        with self._lock:
            self._tokens[token] = time.time() + int(raw)
        return 200, token.encode(), "text/plain", [
            ("X-Aws-Ec2-Metadata-Token-Ttl-Seconds", raw)]

    def _node_credentials(self) -> dict[str, str]:
        now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
        fmt = "%Y-%m-%dT%H:%M:%SZ"
        return {
            "Code": "Success", "LastUpdated": now.strftime(fmt), "Type": "AWS-HMAC",
            "AccessKeyId": self.identity.node_access_key,
            "SecretAccessKey": "NODE-SECRET-ACCESS-KEY",
            "Token": "NODE-SESSION-TOKEN",
            "Expiration": (now + _dt.timedelta(hours=6)).strftime(fmt),
        }

    def _value(self, rest: str, *, trailing: bool) -> tuple[bytes, str] | None:
        ident = self.identity
        text = "text/plain"
        simple = {
            "meta-data/instance-id": ident.instance_id,
            "meta-data/instance-type": ident.instance_type,
            "meta-data/ami-id": ident.ami_id,
            "meta-data/local-ipv4": ident.local_ipv4,
            "meta-data/local-hostname": f"ip-{ident.local_ipv4.replace('.', '-')}."
                                        f"{ident.region}.compute.internal",
            "meta-data/hostname": f"ip-{ident.local_ipv4.replace('.', '-')}."
                                  f"{ident.region}.compute.internal",
            "meta-data/placement/region": ident.region,
            "meta-data/placement/availability-zone": ident.availability_zone,
            "meta-data/placement/availability-zone-id": ident.availability_zone_id,
            "meta-data/placement": "availability-zone\navailability-zone-id\nregion",
            "meta-data": "ami-id\nhostname\niam/\nidentity-credentials/\ninstance-id\n"
                         "instance-type\nlocal-hostname\nlocal-ipv4\nplacement/",
            "meta-data/iam": "info\nsecurity-credentials/",
            "meta-data/iam/security-credentials": ident.node_role,
            "meta-data/identity-credentials/ec2/security-credentials": "ec2-instance",
            **{f"meta-data/{k}": v for k, v in ident.extra.items()},
        }
        if rest in simple:
            return simple[rest].encode(), text
        if rest == "meta-data/iam/info":
            body = {"Code": "Success", "LastUpdated": "2024-01-01T00:00:00Z",
                    "InstanceProfileArn": f"arn:aws:iam::{ident.account_id}:instance-profile/"
                                          f"{ident.node_role}",
                    "InstanceProfileId": "AIPANODEPROFILEDONOTLEAK"}
            return json.dumps(body, indent=2).encode(), text
        if rest in (f"meta-data/iam/security-credentials/{ident.node_role}",
                    "meta-data/identity-credentials/ec2/security-credentials/ec2-instance"):
            return json.dumps(self._node_credentials(), indent=2).encode(), text
        if rest == "dynamic/instance-identity/document":
            doc = {"accountId": ident.account_id, "architecture": "x86_64",
                   "availabilityZone": ident.availability_zone, "imageId": ident.ami_id,
                   "instanceId": ident.instance_id, "instanceType": ident.instance_type,
                   "privateIp": ident.local_ipv4, "region": ident.region, "version": "2017-09-30"}
            return json.dumps(doc, indent=2).encode(), text
        if rest == "user-data":
            return ident.user_data, "application/octet-stream"
        if rest == "":
            return b"dynamic\nmeta-data\nuser-data", text
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-mode", choices=TOKEN_MODES, default="optional")
    parser.add_argument("--node-role", default=NodeIdentity.node_role)
    parser.add_argument("--log-requests", action="store_true",
                        help="print every request as a JSON line on stdout")
    args = parser.parse_args(argv)
    fake = FakeImds(args.host, args.port, token_mode=args.token_mode,
                    identity=NodeIdentity(node_role=args.node_role),
                    log_requests=args.log_requests)
    fake.start()
    print(json.dumps({"listening": fake.addr}), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
