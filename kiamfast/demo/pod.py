"""One demo "pod": a real botocore client whose every TCP connection leaves from the pod's IP.

Why it exists: ``kiamfast demo`` must show the agent handing each pod its own role without
root, so without network namespaces. On Linux every 127/8 address is a local address, so
each demo pod gets one (127.0.10.11, ...) and this process plays the pod: before botocore is
imported it makes every outgoing connection bind that source address, so the agent sees the
pod's IP as the peer, exactly as it sees a real pod's IP behind the DNAT rule.

It then does what every boto3 application does on its first call: resolve credentials
through botocore's default chain. The demo starts it with no AWS_* credentials, no config
files and ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` pointing at the agent on 127.0.0.1, so the
chain ends at the instance-metadata provider, i.e. at the agent. With the credentials it got,
it calls STS ``GetCallerIdentity`` on the local STS, whose answer names the role STS really
issued them for: that, not the agent's listing, is what the demo checks.

Output: one JSON line on stdout (see :func:`run`); exit status 0 whenever the JSON was
written, whatever credentials were (or were not) received: judging is the demo's job.

What it must never do: send anything anywhere but loopback (``--imds`` and
``--sts-endpoint`` are refused unless they are loopback URLs), or fall back to any other
credential source than the metadata service (the demo's environment leaves it none).

Run by hand (``kiamfast demo --keep-running`` prints the line)::

    python -m kiamfast.demo.pod --ip 127.0.10.11 --imds http://127.0.0.1:PORT/ \
        --sts-endpoint http://127.0.0.1:PORT2
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import json
import socket
import sys
import threading
import time
import urllib.parse

__all__ = ["bind_source_address", "main", "run"]

_sources: set[str] = set()
_sources_lock = threading.Lock()
_bound: str | None = None


class NotLoopback(ValueError):
    """A URL or address the pod client was given is not on loopback."""


def _loopback_ip(text: str) -> str:
    ip = ipaddress.ip_address(text)
    if not ip.is_loopback or ip.version != 4:
        raise NotLoopback(f"{text} is not an IPv4 loopback address")
    return str(ip)


def _loopback_url(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        _loopback_ip(host)
    except ValueError:
        raise NotLoopback(f"{url} is not on a 127/8 address") from None
    return url


def _note_source(sock: socket.socket) -> socket.socket:
    with _sources_lock:
        _sources.add(sock.getsockname()[0])
    return sock


def bind_source_address(ip: str) -> None:
    """Make every new TCP connection of this process leave from ``ip``.

    Patches the two functions everything in the stack connects through: urllib3's
    ``create_connection`` (botocore's HTTP, including its metadata fetcher) and
    ``socket.create_connection`` (http.client). Must run before botocore is imported only
    in the sense that nothing may connect earlier; urllib3 looks the function up at each
    connection, so the patch applies to connection pools created later as well.
    """
    global _bound
    if _bound is not None:
        if _bound != ip:
            raise RuntimeError(f"already bound to {_bound}")
        return
    _bound = ip
    import urllib3.util.connection as u3

    original_u3 = u3.create_connection
    original_socket = socket.create_connection

    def u3_create_connection(address, timeout=u3._DEFAULT_TIMEOUT, source_address=None,
                             socket_options=None):
        return _note_source(original_u3(address, timeout, source_address=(ip, 0),
                                        socket_options=socket_options))

    def socket_create_connection(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT,
                                 source_address=None, **kwargs):
        return _note_source(original_socket(address, timeout, source_address=(ip, 0),
                                            **kwargs))

    u3.create_connection = u3_create_connection
    socket.create_connection = socket_create_connection


def _probe_listing(imds: str, ip: str) -> int | None:
    """When botocore found no credentials: what did the agent answer for the role listing?

    One IMDSv2 round (token PUT, listing GET) from the pod's address, so the demo can tell
    "refused (404)" from "unavailable (503)" or "no answer" (None)."""
    import http.client

    parts = urllib.parse.urlsplit(imds)
    try:
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=2,
                                          source_address=(ip, 0))
        conn.request("PUT", "/latest/api/token",
                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        resp = conn.getresponse()
        token = resp.read().decode() if resp.status == 200 else None
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        conn.request("GET", "/latest/meta-data/iam/security-credentials/", headers=headers)
        resp = conn.getresponse()
        resp.read()
        conn.close()
        return resp.status
    except OSError:
        return None


#: Everything besides the metadata service that botocore's default chain could find.
_OTHER_SOURCES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                  "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
                  "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
                  "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                  "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN",
                  "AWS_EC2_METADATA_DISABLED", "AWS_EC2_METADATA_SERVICE_ENDPOINT_MODE")


def leave_only_the_metadata_service(imds: str) -> None:
    """Set this process' environment up like a pod's: the chain can only end at ``imds``."""
    import os

    for name in _OTHER_SOURCES:
        os.environ.pop(name, None)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "BOTO_CONFIG"):
        os.environ[name] = os.devnull
    os.environ["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds


def run(*, ip: str, imds: str, sts_endpoint: str, region: str = "us-east-1") -> dict:
    """Be the pod once; returns what happened.

    Keys: ``ip``; ``method`` (botocore's provider name, ``iam-role`` for the metadata
    service, None without credentials); ``access_key``; ``first_call_ms`` (the credential
    resolution, i.e. the metadata round trips, as the application's first call pays it);
    ``arn`` (GetCallerIdentity) or ``sts_error``; ``listing_status`` (only without
    credentials); ``sources`` (every local address a connection left from); ``error``.
    """
    out: dict = {"ip": ip, "method": None, "access_key": None, "first_call_ms": None,
                 "arn": None, "sts_error": None, "listing_status": None, "error": None}
    bind_source_address(ip)
    import botocore.session  # after the patch, as the module docstring explains

    session = botocore.session.get_session()
    started = time.perf_counter()
    try:
        creds = session.get_credentials()
    except Exception as e:  # noqa: BLE001 - reported, judged by the demo
        creds = None
        out["error"] = f"{type(e).__name__}: {e}"
    out["first_call_ms"] = round((time.perf_counter() - started) * 1000, 1)
    if creds is None:
        out["listing_status"] = _probe_listing(imds, ip)
    else:
        frozen = creds.get_frozen_credentials()
        out["method"] = creds.method
        out["access_key"] = frozen.access_key
        try:
            sts = session.create_client("sts", endpoint_url=sts_endpoint, region_name=region)
            out["arn"] = sts.get_caller_identity()["Arn"]
        except Exception as e:  # noqa: BLE001 - reported, judged by the demo
            out["sts_error"] = f"{type(e).__name__}: {e}"
    with _sources_lock:
        out["sources"] = sorted(_sources)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kiamfast.demo.pod",
                                 description="Resolve AWS credentials as a pod on a loopback "
                                             "address would (see kiamfast demo).")
    ap.add_argument("--ip", required=True, help="the pod's address (127/8)")
    ap.add_argument("--imds", required=True,
                    help="the metadata endpoint the pod uses (the agent), e.g. "
                         "http://127.0.0.1:8181/; botocore reads it from "
                         "$AWS_EC2_METADATA_SERVICE_ENDPOINT, which this sets")
    ap.add_argument("--sts-endpoint", required=True, help="the local STS")
    ap.add_argument("--wait-for-go", action="store_true",
                    help="get ready (imports done), print 'ready', then wait for a line on "
                         "stdin before the first call (EOF: exit without calling)")
    args = ap.parse_args(argv)
    try:
        ip = _loopback_ip(args.ip)
        _loopback_url(args.imds)
        _loopback_url(args.sts_endpoint)
    except ValueError as e:
        ap.error(str(e))
    leave_only_the_metadata_service(args.imds)
    if args.wait_for_go:
        # Pay the interpreter's and botocore's start-up before the clock starts, so the
        # first call happens the moment the demo says so (and its latency is the call's).
        bind_source_address(ip)
        importlib.import_module("botocore.session")

        sys.stdout.write("ready\n")
        sys.stdout.flush()
        if not sys.stdin.readline():
            return 0
    sys.stdout.write(json.dumps(run(ip=ip, imds=args.imds, sts_endpoint=args.sts_endpoint))
                     + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
