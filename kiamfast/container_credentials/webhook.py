"""``kiamfast webhook``: the mutating admission webhook that gives an opting-in pod the two
variables and the token volume of the container-credentials protocol.

A pod opts in with its role annotation (``--iam-role-key``) and ``kiamfast.io/container-
credentials: "true"``, on the pod or, with ``--service-account-opt-in``, on its
ServiceAccount: a ServiceAccount carrying both opts in every pod that runs as it.  The pod
is more specific, so each of the two annotations is the pod's own if it has it, else its
ServiceAccount's: a pod's own role wins over the account's, and a pod's own
``kiamfast.io/container-credentials: "false"`` opts it out of an opted-in account.  A pod
that gets its role from its account gets the role annotation added (the account's value):
the agent reads the role from the pod, as ever, and applies the same policy to it (namespace
restrictions, ``--default-role``).  The account is read from the API server only when the
pod's own annotations do not decide (``accounts``: bounded, cached ~15 s); a read that fails
admits the pod as if its account had no annotations.  Every container and initContainer then gets
``AWS_CONTAINER_CREDENTIALS_FULL_URI`` and ``AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`` and a
read-only mount of a projected service-account token with kiamfast's audience.  A container
that already sets any container-provider variable is left alone: adding only some of them
could send kiamfast's token to an endpoint the container chose.

The webhook only ever allows: every pod is admitted, a pod it does not understand without a
patch (it then gets IMDS by address, kube2iam's contract).  The API server calls it rarely
(pod creations), so the stdlib's threaded HTTPS server is enough.  A renewed serving
certificate (cert-manager, the kubelet's Secret volume update) is picked up by the next
connection, without a restart.
"""
from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import ssl
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kiamfast.config import FLAGS_BY_NAME
from kiamfast.container_credentials.accounts import (
    AccountAnnotations,
    api_client_without_retries,
    service_account_read,
)

log = logging.getLogger("kiamfast.webhook")

OPT_IN_ANNOTATION = "kiamfast.io/container-credentials"
FULL_URI = "http://169.254.170.23/v1/credentials"
VOLUME = "kiamfast-container-credentials-token"
MOUNT_PATH = "/var/run/secrets/kiamfast.io/container-credentials"
TOKEN_FILE = "token"
MIN_EXPIRATION = 600            # the TokenRequest API's floor
MAX_REVIEW_BYTES = 4 << 20      # a pod is at most etcd's 1.5 MiB; the review wraps it once
READ_TIMEOUT = 10.0             # per read, the TLS handshake included
MAX_CONNECTIONS = 64

# Any of these means the container chose its own container-provider settings.
PROVIDER_VARIABLES = frozenset({
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"})


class MalformedReview(ValueError):
    """The request is not an AdmissionReview v1 for a pod we can read."""


def _annotations(pod: dict[str, Any]) -> dict[str, Any]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if not isinstance(annotations, dict):
        raise MalformedReview("metadata.annotations is not an object")
    return annotations


def decided_by_pod(pod: dict[str, Any], *, role_key: str) -> bool:
    """Whether the pod's own annotations settle its opt-in, so its account need not be read:
    its own opt-in wins, and anything but "true" is no whatever the account says; "true"
    beside a role of its own needs nothing from the account."""
    annotations = _annotations(pod)
    opt_in = annotations.get(OPT_IN_ANNOTATION)
    return opt_in is not None and (opt_in != "true" or role_key in annotations)


def effective_role(pod: dict[str, Any], *, role_key: str,
                   account: dict[str, str] | None = None) -> str | None:
    """The role the pod opts in with, None if it does not: each of the two annotations is
    the pod's own if it has it, else its ServiceAccount's (``account``)."""
    own, inherited = _annotations(pod), account or {}
    opt_in = own[OPT_IN_ANNOTATION] if OPT_IN_ANNOTATION in own \
        else inherited.get(OPT_IN_ANNOTATION)
    role = own.get(role_key) if role_key in own else inherited.get(role_key)
    return role if opt_in == "true" and role and isinstance(role, str) else None


def _token_volume(audience: str, expiration: int) -> dict[str, Any]:
    return {"name": VOLUME, "projected": {"sources": [{"serviceAccountToken": {
        "audience": audience, "expirationSeconds": expiration, "path": TOKEN_FILE}}]}}


def _container_patch(base: str, container: dict[str, Any], full_uri: str) -> list[dict]:
    """The operations for one container, none if it sets its own provider variables or
    already mounts something at our path."""
    env = container.get("env") or []
    mounts = container.get("volumeMounts") or []
    if not isinstance(env, list) or not isinstance(mounts, list):
        raise MalformedReview(f"{base}: env or volumeMounts is not a list")
    if any(isinstance(e, dict) and e.get("name") in PROVIDER_VARIABLES for e in env):
        return []
    if any(isinstance(m, dict) and m.get("mountPath") == MOUNT_PATH for m in mounts):
        return []
    ours_env = [{"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": full_uri},
                {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
                 "value": f"{MOUNT_PATH}/{TOKEN_FILE}"}]
    ours_mount = {"name": VOLUME, "mountPath": MOUNT_PATH, "readOnly": True}
    return [*_append(f"{base}/env", env, ours_env),
            *_append(f"{base}/volumeMounts", mounts, [ours_mount])]


def _append(path: str, current: list[Any], items: list[Any]) -> list[dict]:
    """JSONPatch adding ``items`` to the list ``current`` at ``path``; an empty, null or
    absent one is replaced (appending to null is a patch the API server cannot apply)."""
    if not current:
        return [{"op": "add", "path": path, "value": items}]
    return [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def _role_annotation(pod: dict[str, Any], role_key: str, role: str) -> list[dict]:
    """The role annotation, unless the pod has it: the account's role, written on the pod
    for the agent (which reads only pods)."""
    annotations = _annotations(pod)
    if annotations.get(role_key) == role:
        return []
    if not annotations:
        return [{"op": "add", "path": "/metadata/annotations", "value": {role_key: role}}]
    key = role_key.replace("~", "~0").replace("/", "~1")       # RFC 6901
    return [{"op": "add", "path": f"/metadata/annotations/{key}", "value": role}]


def pod_patch(pod: dict[str, Any], *, role_key: str, audience: str, expiration: int,
              full_uri: str = FULL_URI, account: dict[str, str] | None = None) -> list[dict]:
    """The JSONPatch for ``pod``, whose ServiceAccount has the annotations ``account`` (None:
    not read, or not readable); empty if it does not opt in or nothing needs adding."""
    role = effective_role(pod, role_key=role_key, account=account)
    if role is None:
        return []
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise MalformedReview("pod has no spec")
    if not spec.get("serviceAccountName"):
        # The API server refuses a token volume then; the ServiceAccount admission plugin,
        # which runs first, sets it on every cluster that has one.
        log.warning("pod %s opts in but has no serviceAccountName: no token volume",
                    _pod_name(pod))
        return []
    ops: list[dict] = []
    for kind in ("initContainers", "containers"):
        containers = spec.get(kind) or []
        if not isinstance(containers, list):
            raise MalformedReview(f"spec.{kind} is not a list")
        for i, container in enumerate(containers):
            if not isinstance(container, dict):
                raise MalformedReview(f"spec.{kind}[{i}] is not an object")
            ops += _container_patch(f"/spec/{kind}/{i}", container, full_uri)
    volumes = spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise MalformedReview("spec.volumes is not a list")
    has_volume = any(isinstance(v, dict) and v.get("name") == VOLUME for v in volumes)
    if ops and not has_volume:
        ops += _append("/spec/volumes", volumes, [_token_volume(audience, expiration)])
    if ops:
        # A pod none of whose containers takes the variables keeps IMDS by address: it
        # gets no role it did not ask for itself.
        ops = _role_annotation(pod, role_key, role) + ops
    return ops


def _answer(uid: str, ops: list[dict]) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response}


def _account(request: dict[str, Any], pod: dict[str, Any], role_key: str,
             accounts: AccountAnnotations | None) -> dict[str, str] | None:
    """The annotations of the pod's ServiceAccount when they may decide its opt-in; None
    when not needed, not enabled or not readable.  The namespace is the request's: a pod's
    own metadata.namespace may be empty at creation."""
    name = (pod.get("spec") or {}).get("serviceAccountName")
    namespace = request.get("namespace")
    if accounts is None or decided_by_pod(pod, role_key=role_key) \
            or not isinstance(name, str) or not name or not isinstance(namespace, str) \
            or not namespace:
        return None
    return accounts.get(namespace, name)


def review_answer(body: bytes, *, accounts: AccountAnnotations | None = None,
                  **settings: Any) -> dict[str, Any]:
    """The AdmissionReview answer to the request ``body``: always allowed; patched only for
    a pod creation that opts in (``accounts``: where its ServiceAccount's annotations are
    read, None to read none); a review it cannot read is logged and left unpatched."""
    uid = ""
    try:
        review = json.loads(body)
        request = review.get("request") if isinstance(review, dict) else None
        if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
            raise MalformedReview("no request.uid")
        uid = request["uid"]
        kind = request.get("kind") or {}
        if request.get("operation") != "CREATE" or not isinstance(kind, dict) \
                or kind.get("kind") != "Pod" or request.get("subResource"):
            return _answer(uid, [])
        pod = request.get("object")
        if not isinstance(pod, dict):
            raise MalformedReview("no request.object")
        account = _account(request, pod, settings["role_key"], accounts)
        ops = pod_patch(pod, account=account, **settings)
    except Exception as e:   # whatever the shape: admit unchanged, never fail the pod
        log.warning("admission review %r not understood, pod admitted unchanged: %s", uid, e)
        return _answer(uid, [])
    if ops:
        log.info("pod %s/%s: container-credentials variables and token volume added%s",
                 request.get("namespace", ""), _pod_name(pod),
                 " (opted in by its ServiceAccount's annotations)" if account else "")
    return _answer(uid, ops)


def _pod_name(pod: dict[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return metadata.get("name") or metadata.get("generateName", "")


class _Handler(BaseHTTPRequestHandler):
    server_version = "kiamfast-webhook"
    timeout = READ_TIMEOUT
    settings: dict[str, Any] = {}

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != "/mutate":
            self._send(404, b"not found\n", "text/plain")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(411, b"Content-Length required\n", "text/plain")
            return
        if not 0 <= length <= MAX_REVIEW_BYTES:
            self._send(413, b"review too large\n", "text/plain")
            return
        answer = review_answer(self.rfile.read(length), **self.settings)
        self._send(200, json.dumps(answer).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class ServingCertificate:
    """The TLS context of a certificate and key file pair, loaded again when either file
    changes: a stat of each per new connection (cheap next to a handshake) spots the
    kubelet's swap of a Secret volume's ``..data`` link or a file written in place.  A pair
    that does not load (half written, key and certificate not matching, missing) keeps the
    previous one and logs a line; it is tried again once the files change again."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self._seen = self._signature()
        self._context = self._load()        # at start a pair that does not load is fatal

    def context(self) -> ssl.SSLContext:
        seen = self._signature()
        if seen != self._seen:
            self._seen = seen
            try:
                self._context = self._load()
                log.info("serving certificate %s reloaded", self.cert)
            except (OSError, ssl.SSLError) as e:
                log.warning("serving certificate %s and key %s not loaded, serving the "
                            "previous pair: %s", self.cert, self.key, e)
        return self._context

    def _signature(self) -> tuple:
        signature = []
        for path in (self.cert, self.key):
            try:
                s = os.stat(path)           # through the links, to the current files
                signature.append((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size))
            except OSError as e:
                signature.append(e.errno)
        return tuple(signature)

    def _load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once: any pod can reach the
    Service, and a flood must not grow threads without bound (beyond it: closed at once)."""

    daemon_threads = True

    def __init__(self, listen: tuple[str, int], handler: type, max_connections: int,
                 tls: ServingCertificate) -> None:
        super().__init__(listen, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.tls = tls

    def get_request(self) -> tuple[ssl.SSLSocket, Any]:
        sock, address = self.socket.accept()
        # The handshake runs in the request's thread, under its timeout, not in the accept
        # loop; each connection gets the certificate current when it was accepted.
        return self.tls.context().wrap_socket(sock, server_side=True,
                                              do_handshake_on_connect=False), address

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(*, listen: tuple[str, int], cert: str, key: str, settings: dict[str, Any],
                max_connections: int = MAX_CONNECTIONS) -> ThreadingHTTPServer:
    tls = ServingCertificate(cert, key)
    handler = type("Handler", (_Handler,), {"settings": settings})
    return _BoundedServer(listen, handler, max_connections, tls)


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
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    from kiamfast import logs
    logs.setup(level=args.log_level, process="webhook")
    accounts = None
    if args.service_account_opt_in:
        def make_client() -> Any:
            return api_client_without_retries(kubeconfig=args.kubeconfig)
        if args.kubeconfig:         # the user's file: a bad one is bad input, said at once
            try:
                make_client()
            except Exception as e:
                print(f"kiamfast webhook: --kubeconfig {args.kubeconfig}: {e}",
                      file=sys.stderr)
                return 2
        # In-cluster credentials missing are a failed read (logged), not a webhook down:
        # the pods that opt in by their own annotations keep being injected.
        accounts = AccountAnnotations(service_account_read(make_client))
    server = make_server(listen=args.listen, cert=args.tls_cert, key=args.tls_key, settings={
        "role_key": args.iam_role_key, "audience": args.audience,
        "expiration": args.token_expiration, "full_uri": args.full_uri,
        "accounts": accounts})
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
