"""``kiamfast webhook``: the mutating admission webhook that gives an opting-in pod the two
variables and the token volume of the container-credentials protocol.

Its flags and its start: the ServiceAccount reads (`accounts.py`) when asked for, the HTTPS
server (`server.py`), a SIGTERM handler.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kiamfast.config import FLAGS_BY_NAME
from kiamfast.webhook.accounts import (
    AccountAnnotations,
    api_client,
    service_account_read,
)
from kiamfast.webhook.patch import FULL_URI, OPT_IN_ANNOTATION
from kiamfast.webhook.server import make_server

log = logging.getLogger("kiamfast.webhook")

MIN_EXPIRATION = 600            # the TokenRequest API's floor


def _listen_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


def _expiration(text: str) -> int:
    seconds = int(text)
    if seconds < MIN_EXPIRATION:
        raise argparse.ArgumentTypeError(f"at least {MIN_EXPIRATION} (the API's minimum)")
    return seconds


def _audience(text: str) -> str:
    if not text:
        # A projected token without an audience is one for the API server itself.
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kiamfast webhook", description=__doc__.split("\n\n")[0])
    p.add_argument("--tls-cert", required=True, help="PEM certificate (chain) to serve")
    p.add_argument("--tls-key", required=True, help="PEM private key of --tls-cert")
    p.add_argument("--listen", type=_listen_address, default=("0.0.0.0", 8443),
                   help="host:port to serve /mutate and /healthz on (default 0.0.0.0:8443)")
    p.add_argument("--audience", type=_audience, default=FLAGS_BY_NAME["container-credentials-audience"].default,
                   help="audience of the projected token (the agent's "
                        "--container-credentials-audience)")
    p.add_argument("--token-expiration", type=_expiration, default=3600,
                   help=f"expirationSeconds of the token, at least {MIN_EXPIRATION} "
                        "(default 3600)")
    p.add_argument("--iam-role-key", default=FLAGS_BY_NAME["iam-role-key"].default,
                   help="pod annotation holding the role (the agent's --iam-role-key)")
    p.add_argument("--full-uri", default=FULL_URI,
                   help=f"AWS_CONTAINER_CREDENTIALS_FULL_URI to inject (default {FULL_URI})")
    p.add_argument("--service-account-opt-in", action="store_true",
                   help="also opt in the pods of a ServiceAccount annotated with the role and "
                        f"{OPT_IN_ANNOTATION}: \"true\" (reads ServiceAccounts: needs RBAC "
                        "get on serviceaccounts)")
    p.add_argument("--kubeconfig", default="",
                   help="kubeconfig to read ServiceAccounts with (default: in-cluster)")
    p.add_argument("--log-level", default="info",
                   help="debug, info, warn or error (as the agent's --log-level)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text or json, as the agent's --log-format (default text)")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    from kiamfast import logs
    logs.setup(log_format=args.log_format, level=args.log_level, process="webhook")
    accounts = None
    if args.service_account_opt_in:
        def make_client() -> Any:
            return api_client(kubeconfig=args.kubeconfig)
        if args.kubeconfig:         # the user's file: a bad one is bad input, said at once
            try:
                make_client()
            except Exception as e:
                log.error("cannot start: --kubeconfig %s: %s", args.kubeconfig, e)
                return 2
        # In-cluster credentials missing are a failed read (logged), not a webhook down:
        # the pods that opt in by their own annotations keep being injected.
        accounts = AccountAnnotations(service_account_read(make_client))
    try:
        server = make_server(listen=args.listen, cert=args.tls_cert, key=args.tls_key,
                             settings={"role_key": args.iam_role_key, "audience": args.audience,
                                       "expiration": args.token_expiration,
                                       "full_uri": args.full_uri, "accounts": accounts})
    except ssl.SSLError as e:
        log.error("cannot start: --tls-cert %s and --tls-key %s do not load as a PEM "
                  "certificate and its key (%s)", args.tls_cert, args.tls_key, e)
        return 1
    except OSError as e:
        unreadable = [f"{flag} {path}" for flag, path in (("--tls-cert", args.tls_cert),
                                                         ("--tls-key", args.tls_key))
                      if not os.access(path, os.R_OK)]
        where = ", ".join(unreadable) or f"--listen {args.listen[0]}:{args.listen[1]}"
        log.error("cannot start: %s: %s", where, e.strerror or e)
        return 1
    # As a container's PID 1 it gets no default action for SIGTERM: without a handler the
    # kubelet waits out the whole grace period on every rollout and scale-down.
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(
        target=server.shutdown, daemon=True).start())
    log.info("serving the injection webhook on https://%s:%d/mutate", *args.listen)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log.info("the injection webhook stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
